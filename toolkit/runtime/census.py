"""What the served path runs on the device, counted op by op (TOOLKIT_CENSUS=DIR): every torch operation each step
dispatches on this rank, with its FLOPs, the bytes its tensors span and its dtype, attributed to the probe region it
runs in, and every vendor-library call (a stand-in's CPU reference) as one kernel of the image's library.

A step is an outermost probe region (`step`, ModelRunner.execute_model, with TOOLKIT_PROFILE=1): the count starts as
it starts and is written as it ends, one JSON line a step to DIR/census-<pid>.jsonl, so a worker killed at exit
keeps every step it finished. What is counted, by rule:
- a torch operation at the dispatcher (a `TorchDispatchMode`, below autograd and the function modes): a view or an
  allocation launches nothing and is not counted; vLLM's own custom ops (`torch.ops.vllm.*`) are Python wrappers
  whose insides are counted where they run (torch runs a custom op's kernel with the modes off: the vendor call in
  it is counted by the stand-ins' hook, as one kernel without FLOPs, and its torch ops are not);
- a torch.distributed operation (c10d: the logits' gather, a broadcast) is a collective of its largest tensor; inside
  a vendor call (gloo carrying ixformer's all-reduce here) it is that call's;
- FLOPs: torch's own formulas (`torch.utils.flop_counter`: matmuls, convolutions, attention) where torch has one,
  attention on the CPU by the same formula (4 b h q k d), anything else one FLOP per output element;
- bytes: each distinct tensor the operation reads or writes, once (a view of a weight counts the slice it spans;
  a gather, such as indexing the selected experts' weights or an embedding, reads as many bytes as it writes);
- a stand-in's call with a tensor (ixformer's all-reduce, attention, activations; not a group handle's) is one
  kernel of the vendor's (an all-gather or a reduce-scatter priced as an all-reduce): its FLOPs are
  those its CPU reference dispatched, its bytes its tensors'; an all-reduce is a collective of its tensor's bytes,
  with no FLOPs (the device model prices it over the link);
- a scatter (`cache[slots] = keys`) writes as many bytes as it is given, not its destination's;
- a prebuilt kernel's call (the image's `corex_*` modules), and a vendor call handed the whole paged KV cache (its
  attention, its cache write: `PAGED`), is one launch whose bytes are what it reads of its arguments and what it
  writes: each argument's storage read as its reference's operations read it (a gather the rows it selects, any
  other operation the view it spans), at most the whole storage; its results and what it writes of its arguments
  (a scatter the rows it is given, any other operation the view it spans). The reference's own intermediates (a
  gathered copy, a float32 widening) are registers and shared memory in the kernel, not traffic.

A rank that fails (an exception in its worker, or its process dying) leaves its error as DIR/failed-<pid>.json the
moment vLLM's own worker code logs it (the rank's exception in the rank, a dead rank's exit code in the driver's
worker monitor): the other ranks then wait on it in a collective until gloo's 30-minute timeout, so whoever runs the
census watches for that file (`failures`) and ends the census at once.

Copied beside the stand-ins as `toolkit_census` and installed by their sitecustomize when TOOLKIT_CENSUS is set;
torch is imported when the first step starts.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

ENV = "TOOLKIT_CENSUS"
PATTERN = "census-*.jsonl"
FAILED = "failed-*.json"
# vLLM 0.6.3's multiprocessing executor logs, at ERROR, a rank's exception ("Exception in worker ...") in the rank and
# a rank's death ("Worker ... died, exit code: ...") in the driver; nothing else it logs at ERROR
WORKER_LOGGER = "vllm.executor.multiproc_worker_utils"
# the vendor calls that move a tensor between ranks: priced over the link, not the card
COLLECTIVES = frozenset({"ixformer.distributed.all_reduce", "ixformer.distributed.all_gather",
                         "ixformer.distributed.reduce_scatter"})
# operations that launch no kernel: an allocation (its memory is the caching allocator's), autograd's bookkeeping
NO_KERNEL = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "detach_",
                       "lift_fresh", "alias", "set_", "resize_", "record_stream"})
# vLLM's custom ops wrap Python (what runs inside is counted where it runs)
WRAPPERS = frozenset({"vllm"})
OUTSIDE = "(outside every region)"
# operations that read only the rows they gather from their first argument (an expert's weights, an embedding's rows)
GATHERS = frozenset({"index", "index_select", "gather", "embedding", "take"})
# operations that write only the rows they scatter into their first argument (a token's keys into the paged cache)
SCATTERS = frozenset({"index_put", "index_put_", "_index_put_impl_"})
# vendor calls handed the whole paged KV cache, of which they read or write a sequence's blocks: priced as a prebuilt
# kernel's call is, by what their reference touches of their arguments (the cache's size is the census's choice)
PAGED = frozenset({"ixformer.functions.vllm_single_query_cached_kv_attention",
                   "ixformer.functions.vllm_cache_ops_reshape_and_cache"})


class CensusError(RuntimeError):
    pass


def _standins() -> types.ModuleType:
    try:
        return importlib.import_module("toolkit_standins")  # beside this file in the runtime
    except ModuleNotFoundError:
        from toolkit.runtime import standins  # the toolkit's side, in its tests

        return standins


class Tally:
    """One step's (or one vendor call's) count: (region, op, dtype, kind, shapes) -> [calls, FLOPs, bytes]; for a
    prebuilt kernel's call, also what its reference read of the kernel's arguments and wrote into them."""

    def __init__(self, arguments: list[Any] | None = None) -> None:
        self.ops: dict[tuple[str, str, str, str, str], list[float]] = {}
        # a kernel's arguments: storage -> its size; per storage, each distinct view read or written -> its bytes
        self.arguments = {_storage(t): _storage_bytes(t) for t in arguments or []}
        self.read: dict[int, dict[tuple[Any, ...], float]] = {}
        self.written: dict[int, dict[tuple[Any, ...], float]] = {}

    def touch(self, ins: list[Any], outs: list[Any], gathered: Any | None, scattered: Any | None = None) -> None:
        """An operation of a kernel's reference: the argument views it reads (`gathered`, a gather's source, read as
        many bytes as the gather writes) and those it writes in place (`scattered`, a scatter's destination, written
        as many bytes as it is given: its last input)."""
        if not self.arguments:
            return
        for tensor in ins:
            storage = _storage(tensor)
            if storage in self.arguments and tensor is not scattered:
                nbytes = _bytes(outs) if tensor is gathered else _bytes([tensor])
                key = ("gather", _view(tensor), _view_all(outs)) if tensor is gathered else _view(tensor)
                self.read.setdefault(storage, {})[key] = nbytes
        for tensor in outs:
            storage = _storage(tensor)
            if storage in self.arguments:
                if scattered is not None and storage == _storage(scattered):
                    rows = ("scatter", _view(tensor), _view_all(ins[1:]))
                    self.written.setdefault(storage, {})[rows] = _scattered_bytes(scattered, ins)
                else:
                    self.written.setdefault(storage, {})[_view(tensor)] = _bytes([tensor])

    def traffic(self, results: list[Any]) -> float:
        """What the kernel moves: each argument's storage as read and as written (each at most its size), and its
        results not among its arguments."""
        total = 0.0
        for touched in (self.read, self.written):
            total += sum(min(sum(views.values()), self.arguments[s]) for s, views in touched.items())
        fresh = [t for t in results if _storage(t) not in self.arguments]
        return total + _bytes(fresh)

    def add(self, region: str, op: str, dtype: str, kind: str, shapes: str, flops: float, nbytes: float) -> None:
        entry = self.ops.setdefault((region, op, dtype, kind, shapes), [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += flops
        entry[2] += nbytes

    @property
    def flops(self) -> float:
        return sum(entry[1] for entry in self.ops.values())

    @property
    def nbytes(self) -> float:
        return sum(entry[2] for entry in self.ops.values())

    def rows(self) -> list[list[Any]]:
        return [[*key, int(calls), flops, nbytes] for key, (calls, flops, nbytes) in sorted(self.ops.items())]


class Census:
    """The counting in one process: `start()`/`stop()` around each step, `count` for each dispatched operation,
    `vendor` around each stand-in's call; `region` names where the code runs now (the probes' innermost region)."""

    def __init__(self, region: Callable[[], tuple[str, str] | None], write: Callable[[dict[str, Any]], None]):
        self.region = region
        self.write = write
        self.steps = 0
        self.tallies: list[Tally] = []  # the step's, then one per vendor call running inside it
        self.bucket, self.step = "all", OUTSIDE
        self.mode: Any = None

    def start(self) -> None:
        import torch

        where = self.region()
        self.bucket, self.step = where if where else ("all", OUTSIDE)
        self.tallies = [Tally()]
        self.mode = _mode_class(torch)(self)
        self.mode.__enter__()

    def stop(self) -> None:
        if self.mode is None:
            return
        self.mode.__exit__(None, None, None)
        self.mode = None
        self.steps += 1
        self.write({"pid": os.getpid(), "rank": _rank(), "step": self.steps, "region": self.step,
                    "bucket": self.bucket, "ops": self.tallies[0].rows()})
        self.tallies = []

    def where(self) -> str:
        found = self.region()
        return found[1] if found else OUTSIDE

    def count(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if not self.tallies:
            return
        rule = _RULES[func] if func in _RULES else _rule(func)
        if rule is None:
            return
        label, formula, gather, attention = rule
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        tensors = ins + outs
        if not tensors:
            return
        shapes = _shapes(ins)
        if func.namespace == "c10d":  # a collective with no vendor call around it (a gather, a broadcast)
            self.tallies[-1].add(self.where(), label, _dtype(tensors), "collective", shapes, 0.0, _largest(tensors))
            return
        first = ins[0] if ins and args and args[0] is ins[0] else None  # the source, or the destination, comes first
        gathered = first if gather else None
        scattered = first if label.rsplit(".", 1)[-1] in SCATTERS and len(ins) > 1 else None
        # a scatter reads its indices and values, and writes as many rows as it is given
        nbytes = _bytes(tensors) if scattered is None else _bytes(ins[1:]) + _scattered_bytes(scattered, ins)
        if gathered is not None:
            nbytes += _bytes(outs) - _bytes(ins[:1])  # the rows it read are as many as it wrote
        self.tallies[-1].touch(ins, outs, gathered, scattered)
        if formula is not None:
            flops = float(formula(*args, **kwargs, out_val=out))
        elif attention and len(ins) >= 2 and ins[0].dim() == 4:
            batch, heads, q_len, size = ins[0].shape  # (batch, heads, tokens, head size)
            flops = 4.0 * int(batch) * int(heads) * int(q_len) * int(ins[1].shape[-2]) * int(size)
        else:
            flops = float(max((t.numel() for t in outs), default=0))
        self.tallies[-1].add(self.where(), label, _dtype(tensors), "kernel", shapes, flops, nbytes)

    def vendor(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.tallies:
            return fn(*args, **kwargs)
        kernel = name in PAGED or any(name.startswith(k + ".") for k in _standins().RECORD.get("kernels", ()))
        # a prebuilt kernel is handed whole weight stacks and caches it reads a few rows of (the selected experts, a
        # sequence's blocks): what its reference reads of them is tracked
        inner = Tally(_tensors((args, kwargs)) if kernel else None)
        self.tallies.append(inner)
        try:
            out = fn(*args, **kwargs)
        finally:
            self.tallies.pop()
        tensors = _tensors((args, kwargs, out))
        if not tensors:  # a handle (a group, a stream): nothing launched
            return out
        dtype, shapes = _dtype(tensors), _shapes(_tensors(args))
        if name in COLLECTIVES:  # priced by the buffer it moves over the link
            self.tallies[-1].add(self.where(), name, dtype, "collective", shapes, 0.0, _largest(tensors))
        else:
            nbytes = inner.traffic(_tensors(out)) if kernel else _bytes(tensors)
            self.tallies[-1].add(self.where(), name, dtype, "vendor", shapes, inner.flops, nbytes)
        return out


_MODES: dict[int, type] = {}


def _mode_class(torch: Any) -> type:
    """The dispatch mode (defined once torch is imported: this module imports without it)."""
    if id(torch) not in _MODES:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import flop_registry

        class Counting(TorchDispatchMode):  # type: ignore[no-untyped-call]
            def __init__(self, census: Census) -> None:
                super().__init__()  # type: ignore[no-untyped-call]
                self.census = census

            def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                                   kwargs: dict[str, Any] | None = None) -> Any:
                kwargs = kwargs or {}
                if func.namespace == "aten" and func.overloadpacket not in flop_registry:
                    # a composite (linear, matmul, einsum) reaches the mode whole under inference mode: counted as
                    # the kernels it decomposes into, as torch's own flop counter does
                    with self:
                        out = func.decompose(*args, **kwargs)
                    if out is not NotImplemented:
                        return out
                out = func(*args, **kwargs)
                self.census.count(func, args, kwargs, out)
                return out

        _MODES[id(torch)] = Counting
    return _MODES[id(torch)]


def _tensors(tree: Any) -> list[Any]:
    import torch
    from torch.utils._pytree import tree_leaves

    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


# per operation: None (launches nothing) or (its name, torch's FLOP formula, a gather, attention)
_RULES: dict[Any, tuple[str, Any, bool, bool] | None] = {}


def _rule(func: Any) -> tuple[str, Any, bool, bool] | None:
    from torch.utils.flop_counter import flop_registry

    name = func.overloadpacket.__name__
    if func.namespace in WRAPPERS or name in NO_KERNEL or func.is_view:
        _RULES[func] = None
    else:
        _RULES[func] = (f"{func.namespace}.{name}", flop_registry.get(func.overloadpacket), name in GATHERS,
                        name.startswith("_scaled_dot_product"))
    return _RULES[func]


def _shapes(inputs: list[Any]) -> str:
    """The shapes of an operation's first two tensor arguments, e.g. `1x2048,512x2048`."""
    return ",".join("x".join(map(str, t.shape)) for t in inputs[:2])


def _largest(tensors: list[Any]) -> float:
    """A collective's buffer: the largest tensor it moves."""
    return float(max(t.numel() * t.element_size() for t in tensors))


def _storage(tensor: Any) -> int:
    return int(tensor.untyped_storage().data_ptr())


def _storage_bytes(tensor: Any) -> float:
    return float(tensor.untyped_storage().nbytes())


def _view(tensor: Any) -> tuple[Any, ...]:
    return (tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


def _view_all(tensors: list[Any]) -> tuple[Any, ...]:
    return tuple((_storage(t), *_view(t)) for t in tensors)


def _bytes(tensors: list[Any]) -> float:
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...], Any]] = set()
    total = 0
    for tensor in tensors:
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return float(total)


def _scattered_bytes(destination: Any, ins: list[Any]) -> float:
    """What a scatter writes into `destination`: its values (its last input) at the destination's element size."""
    return float(ins[-1].numel() * destination.element_size())


def _dtype(tensors: list[Any]) -> str:
    """The widest floating dtype among the tensors (the one the kernel computes in), else the first one's."""
    floating = [t for t in tensors if t.dtype.is_floating_point]
    chosen = max(floating, key=lambda t: t.element_size()) if floating else tensors[0]
    return str(chosen.dtype).removeprefix("torch.")


def _rank() -> int | None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return None


def _writer(folder: str) -> Callable[[dict[str, Any]], None]:
    def write(line: dict[str, Any]) -> None:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"census-{os.getpid()}.jsonl"), "a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")

    return write


class _Failures(logging.Handler):
    """Each ERROR record of vLLM's worker utilities, written as this process's failure (the first one kept: what
    follows it is the shutdown it caused)."""

    def __init__(self, folder: str) -> None:
        super().__init__(logging.ERROR)
        self.folder = folder

    def emit(self, record: logging.LogRecord) -> None:
        path = os.path.join(self.folder, f"failed-{os.getpid()}.json")
        if os.path.exists(path):
            return
        os.makedirs(self.folder, exist_ok=True)
        partial = path + ".partial"
        with open(partial, "w", encoding="utf-8") as out:
            json.dump({"pid": os.getpid(), "rank": _rank(), "message": record.getMessage()}, out)
        os.replace(partial, path)  # whole or absent: the watcher may read it at any moment


def failures(folder: Any) -> list[dict[str, Any]]:
    """The failures the census's processes wrote in `folder` (none while every rank is healthy)."""
    if not os.path.isdir(folder):
        return []
    found = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("failed-") and name.endswith(".json"):
            with open(os.path.join(folder, name), encoding="utf-8") as source:
                found.append(json.load(source))
    return found


def read(folder: Any) -> list[dict[str, Any]]:
    """Every step every process of a census wrote in `folder`, in each process's order."""
    lines: list[dict[str, Any]] = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("census-") and name.endswith(".jsonl"):
            with open(os.path.join(folder, name), encoding="utf-8") as source:
                lines += [json.loads(line) for line in source if line.strip()]
    return lines


def install(folder: str) -> Census:
    """Count every step of this process into `folder`: once the probes' profiling module is imported, each outermost
    region is a step, and every stand-in's reference runs through the census."""
    holder: dict[str, Any] = {}
    census = Census(lambda: holder["profiling"].current() if "profiling" in holder else None, _writer(folder))
    standins = _standins()

    def hook(profiling: types.ModuleType) -> None:
        holder["profiling"] = profiling
        profiling.watch(census.start, census.stop)

    standins.after_import("native_fastpaths.profiling", hook)
    standins.after_import(WORKER_LOGGER, lambda module: module.logger.addHandler(_Failures(folder)))
    standins.call_references_through(census.vendor)
    return census


def from_environment(environ: Mapping[str, str]) -> Census | None:
    """The one reader of TOOLKIT_CENSUS: unset or empty is off; an absolute folder turns the census on; anything
    else is refused."""
    value = environ.get(ENV, "")
    if not value:
        return None
    if not os.path.isabs(value):
        raise CensusError(f"{ENV}={value!r} is not an absolute folder: set it to one, or unset it")
    return install(value)
