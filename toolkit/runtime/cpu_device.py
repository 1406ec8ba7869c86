"""The vendor's GPU path on CPU tensors: vLLM's CUDA platform, its GPU executor (and the multiprocessing executor
at TP > 1), `Worker`, `ModelRunner`, `CacheEngine` and the attention backend the vendor's selector picks run
unchanged, and every tensor they put on "cuda" is made on the CPU. Each deviation from the device is one named
shim below (SHIMS: what it changes and why), applied from outside the tree by the sitecustomize the stand-ins
write, so every Python the runtime starts (a worker, the engine process) runs the same; the applied ones are in the
stand-ins' record under "shims".

Turned on by TOOLKIT_CPU_DEVICE=on (its value is parsed by `from_environment` alone), with the recipe's
accelerators emulated (TOOLKIT_EMULATED_DEVICES: the memory the profile run is measured against). Copied beside
the stand-ins as `toolkit_cpu_device`; it needs torch, which it patches once torch is imported.
"""

from __future__ import annotations

import contextlib
import importlib
import mmap
import os
import platform
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any


def _standins() -> types.ModuleType:
    try:
        return importlib.import_module("toolkit_standins")  # beside this file in the runtime
    except ModuleNotFoundError:
        from toolkit.runtime import standins  # the toolkit's side: the names of the shims, for its report

        return standins


standins = _standins()

ENV = "TOOLKIT_CPU_DEVICE"

SHIMS: dict[str, str] = {
    "cuda-tensors-on-cpu": "a tensor the tree puts on cuda (device=, .to(), .cuda()) is made on the CPU, and "
                           "pinning it (pin_memory=True, .pin_memory()) is left out: a torch function mode, entered "
                           "in every thread",
    "device-tensor-tests": "a tensor answers the vendor tree's own `is_cpu` False and `is_cuda` True, as each tensor "
                           "it computes with does on the device, so the tree takes its device branches "
                           "(_all_reduce_in_place's ixformer all-reduce, not upstream's CPU branch, which the image "
                           "never takes); torch's own code, native_fastpaths, the stand-ins and `device` still "
                           "see the CPU",
    "torch-cuda-calls": "torch.cuda's device, stream, event, seed and synchronize calls act on the one CPU "
                        "(no-ops); the device's name, count, capability and properties are the emulated device's",
    "emulated-memory": "torch.cuda.mem_get_info reads the emulated device's memory less this process's growth: its "
                       "peak resident memory since the last empty_cache (as a caching allocator's reserved memory "
                       "is), so the vendor's profile run measures its real CPU peak",
    "gloo-for-nccl": "torch.distributed's nccl backend is gloo: the TP groups (and the ixformer all-reduce on them) "
                     "run between the CPU processes; a two-rank all-reduce of up to 1 MiB goes through shared memory "
                     "(the same sum, a + b, without gloo's 1 ms loopback round trip)",
}
# what the runtime changes of what a model generates, for a request that asks for it alone (not a deviation the
# device path needs, as SHIMS are: nothing else runs differently)
FORCING: dict[str, str] = {
    "forced-literal-tokens": "a guided_regex that matches exactly one string is served as the served tokenizer's own "
                             "ids of that string, one forced per step, then the end of sequence: a random tiny model "
                             "writes the family's formats as the real model would (each special token its one id), "
                             "where outlines would let it spell `</think>` out of byte pieces; any other guided "
                             "request is outlines', unchanged",
}


def literal_of(pattern: str) -> str | None:
    """The one string a regex matches, when it is a plain sequence of literal characters (escapes included); else
    None."""
    # Python 3.11+ names the parser re._parser; the image's 3.10 sre_parse (deprecated since)
    parser = importlib.import_module("re._parser" if sys.version_info >= (3, 11) else "sre_parse")
    try:
        items = list(getattr(parser, "parse")(pattern))  # noqa: B009
    except Exception:
        return None
    literal = getattr(parser, "LITERAL")  # noqa: B009
    if any(op is not literal for op, _ in items):
        return None
    return "".join(chr(code) for _, code in items)


class ForcedTokens:
    """A logits processor (vLLM's two-argument form) that leaves only the next of `ids`, then `eos`."""

    def __init__(self, ids: list[int], eos: int) -> None:
        self.ids, self.eos = ids, eos

    def __call__(self, output_ids: list[int], logits: Any) -> Any:
        step = len(output_ids)
        target = self.ids[step] if step < len(self.ids) else self.eos
        forced = logits.new_full(logits.shape, float("-inf"))
        forced[target] = 0.0
        return logits + forced


def _forced(guided_params: Any, tokenizer: Any) -> ForcedTokens | None:
    pattern = getattr(guided_params, "regex", None)
    literal = literal_of(pattern) if isinstance(pattern, str) else None
    if literal is None:
        return None
    return ForcedTokens(list(tokenizer.encode(literal, add_special_tokens=False)), int(tokenizer.eos_token_id))


def _forced_literals(guided: types.ModuleType) -> None:
    original_async = getattr(guided, "get_guided_decoding_logits_processor")  # noqa: B009 - a module of the tree
    original_local = getattr(guided, "get_local_guided_decoding_logits_processor")  # noqa: B009

    async def get_guided_decoding_logits_processor(guided_params: Any, tokenizer: Any) -> Any:
        forced = _forced(guided_params, tokenizer)
        return forced if forced is not None else await original_async(guided_params, tokenizer)

    def get_local_guided_decoding_logits_processor(guided_params: Any, tokenizer: Any) -> Any:
        forced = _forced(guided_params, tokenizer)
        return forced if forced is not None else original_local(guided_params, tokenizer)

    setattr(guided, "get_guided_decoding_logits_processor", get_guided_decoding_logits_processor)  # noqa: B010
    setattr(guided, "get_local_guided_decoding_logits_processor", get_local_guided_decoding_logits_processor)  # noqa: B010
    standins.shim_applied("forced-literal-tokens")


class CpuDeviceError(RuntimeError):
    """The CPU-device mode was asked for something it cannot be."""


def _peak_rss() -> int:
    """This process's peak resident memory so far (VmHWM): what a device's allocator peak is to its profile run."""
    with open("/proc/self/status", encoding="ascii") as handle:
        line = next(line for line in handle if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _reset_peak() -> None:
    """The peak back to the current resident memory, as torch.cuda.empty_cache gives the caching allocator's
    reserved memory back: what a device then reports used is the peak since."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")


_START_RSS = _peak_rss()


def _in_tree() -> bool:
    """Whether the code that asked (the frame past the property's getter) is the vendor tree's: torch's own code
    a tree function calls still gets torch's answer."""
    vllm = sys.modules.get("vllm")
    if vllm is None or not getattr(vllm, "__file__", None):
        return False
    return sys._getframe(2).f_code.co_filename.startswith(os.path.dirname(str(vllm.__file__)) + os.sep)


def _on_cpu_tensors(torch: types.ModuleType) -> None:
    from torch.overrides import TorchFunctionMode

    def cpu(device: Any) -> Any:
        if isinstance(device, str) and device.startswith("cuda"):
            return "cpu"
        if isinstance(device, torch.device) and device.type == "cuda":
            return torch.device("cpu")
        if isinstance(device, int) and not isinstance(device, bool):  # a bare index is a cuda device
            return "cpu"
        return device

    tensor = torch.Tensor
    copies = {tensor.cuda, tensor.pin_memory}  # a copy on the device: a new tensor, as there

    class OnCpu(TorchFunctionMode):
        def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                               kwargs: dict[str, Any] | None = None) -> Any:
            kwargs = dict(kwargs or {})
            if func in copies:
                return args[0].clone()
            if func is tensor.is_pinned:
                return False
            kwargs.pop("pin_memory", None)
            moved = False
            if "device" in kwargs:
                moved = cpu(kwargs["device"]) is not kwargs["device"]
                kwargs["device"] = cpu(kwargs["device"])
            if func is tensor.to and len(args) > 1 and cpu(args[1]) is not args[1]:
                args, moved = (args[0], cpu(args[1]), *args[2:]), True
            if func is tensor.to and moved:
                kwargs["copy"] = True  # .to(cuda) of a CPU tensor is a new tensor on the device, never the same one
            return func(*args, **kwargs)

    mode = OnCpu()
    mode.__enter__()  # type: ignore[no-untyped-call]  # this thread, for the life of the process
    bootstrap = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def in_mode(thread: threading.Thread) -> None:
        with OnCpu():
            bootstrap(thread)

    threading.Thread._bootstrap_inner = in_mode  # type: ignore[attr-defined]
    standins.shim_applied("cuda-tensors-on-cpu")


def _device_tests(torch: types.ModuleType) -> None:
    """torch.Tensor's is_cpu and is_cuda as properties that answer the tree as the device would. A property, not the
    function mode: torch runs a custom op's Python kernel (vLLM's inplace_all_reduce, which calls
    _all_reduce_in_place) with the function modes off."""
    def answer(name: str, on_device: bool) -> None:
        # the C tensor base's descriptor, below torch.Tensor in its MRO
        real = next(vars(k)[name] for k in torch.Tensor.__mro__[1:] if name in vars(k))

        def get(self: Any) -> bool:
            return on_device if _in_tree() else bool(real.__get__(self))

        setattr(torch.Tensor, name, property(get))

    answer("is_cpu", False)
    answer("is_cuda", True)
    standins.shim_applied("device-tensor-tests")


class _Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _Stream(_Event):
    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass


def _torch_cuda(torch: types.ModuleType, devices: dict[str, Any], without: tuple[str, ...]) -> None:
    cuda = torch.cuda
    count = int(devices["count"])
    major, minor = (int(c) for c in devices.get("capability", (7, 0)))
    total = int(float(devices["memory_gb"]) * 2**30)
    properties = types.SimpleNamespace(name="emulated accelerator", total_memory=total, major=major, minor=minor,
                                       multi_processor_count=16)

    def used() -> int:
        return max(_peak_rss() - _START_RSS, 0)

    @contextlib.contextmanager
    def context(*args: Any, **kwargs: Any) -> Iterator[None]:
        yield

    def nothing() -> Callable[..., None]:
        # a new function per name: torch's compiler keeps a rule per torch.cuda function and refuses a shared one
        return lambda *args, **kwargs: None

    calls: dict[str, Any] = {
        **{name: nothing() for name in ("set_device", "synchronize", "manual_seed", "manual_seed_all", "ipc_collect",
                                        "init")},
        "current_device": lambda: 0, "device_count": lambda: count, "is_initialized": lambda: True,
        "get_device_name": lambda *a: properties.name, "get_device_capability": lambda *a: (major, minor),
        "get_device_properties": lambda *a: properties, "can_device_access_peer": lambda *a: False,
        "is_current_stream_capturing": lambda: False,
        "Event": _Event, "Stream": _Stream, "current_stream": lambda *a: _Stream(),
        "default_stream": lambda *a: _Stream(),
        "stream": context, "device": context,
    }
    if "torch-cuda-calls" not in without:
        for name, value in calls.items():
            setattr(cuda, name, value)
        standins.shim_applied("torch-cuda-calls")
    if "emulated-memory" in without:
        return
    cuda.empty_cache = lambda: _reset_peak()
    cuda.reset_peak_memory_stats = lambda *a: _reset_peak()
    cuda.mem_get_info = lambda *a: (total - used(), total)
    cuda.max_memory_allocated = lambda *a: used()
    cuda.memory_allocated = lambda *a: used()
    standins.shim_applied("emulated-memory")


def _gloo(torch: types.ModuleType) -> None:
    import torch.distributed as dist

    def gloo(function: Callable[..., Any], position: int) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if len(args) > position and args[position] == "nccl":
                args = (*args[:position], "gloo", *args[position + 1:])
            if kwargs.get("backend") == "nccl":
                kwargs["backend"] = "gloo"
            return function(*args, **kwargs)

        return call

    dist.init_process_group = gloo(dist.init_process_group, 0)
    dist.new_group = gloo(dist.new_group, 2)
    dist.all_reduce = _paired_all_reduce(torch, dist.all_reduce)
    standins.shim_applied("gloo-for-nccl")


# a two-rank group's all-reduce of a small tensor through shared memory (_Pair) instead of gloo's loopback TCP: gloo's
# took 1.0-1.1 ms a call between two idle processes here, about 16 calls a decode step of the rehearsal's TP 2, a
# third of the step; anything larger, another op, an asynchronous call or another group size stays gloo's
PAIR_SLOT_BYTES = 1 << 20
PAIR_WAIT_S = 1800.0  # gloo's own default timeout: a peer that never arrives ends in an error, not a hang
PAIR_SPINS = 2000  # yields before the wait sleeps between looks (a peer descheduled for long)
PAIR_DIR = "/dev/shm"  # memory, where the machine has it; else the temporary folder's page cache


class _Pair:
    """One two-rank group's all-reduce through a shared-memory segment. Each rank copies its tensor into its slot of
    the call's parity, publishes the call's number, waits for the peer's, and adds slot 0 and slot 1: the same sum
    on both ranks, and gloo's (a + b is b + a). A slot is written again two calls later, which its writer reaches only
    after the peer published the call between, that is after the peer read this one. The published numbers are
    plain stores, ordered after the data's on x86 (the only machine this runs on, `_pairable`)."""

    def __init__(self, torch: types.ModuleType, rank: int, memory: mmap.mmap) -> None:
        self.torch = torch
        self.rank = rank
        self.memory = memory
        buf = memoryview(memory)
        self.published = buf[:16].cast("q")
        self.slots = [[torch.frombuffer(buf, dtype=torch.uint8, count=PAIR_SLOT_BYTES,
                                        offset=64 + (2 * parity + owner) * PAIR_SLOT_BYTES) for owner in (0, 1)]
                      for parity in (0, 1)]
        self.calls = 0

    @classmethod
    def open(cls, torch: types.ModuleType, dist: Any, group: Any) -> _Pair | None:
        """Both ranks' pair, or None on both (gloo's all-reduce then) when either could not map the segment.

        The segment is a file both ranks map, unlinked once both hold it, so nothing is left behind whatever ends
        them later. Not multiprocessing's SharedMemory: its resource tracker is the one the vendor's TP worker shares
        with the leader (one rank's unregister broke the other's unlink: a KeyError traceback in the server log at
        every stop), and its __del__ cannot close a segment tensors still view ("BufferError: cannot close exported
        pointers exist" at every exit)."""
        rank = dist.get_rank(group)
        size = 64 + 4 * PAIR_SLOT_BYTES
        names, fd, memory = [""], -1, None
        if rank == 0:
            with contextlib.suppress(OSError):
                fd, names[0] = tempfile.mkstemp(prefix="toolkit-pair-", dir=PAIR_DIR if os.path.isdir(PAIR_DIR)
                                                else None)
                os.ftruncate(fd, size)  # before the peer learns the name: it maps the whole size
        dist.broadcast_object_list(names, src=dist.get_process_group_ranks(group)[0], group=group)
        if names[0]:
            with contextlib.suppress(OSError, ValueError):
                if rank != 0:
                    fd = os.open(names[0], os.O_RDWR)
                memory = mmap.mmap(fd, size)
        if fd >= 0:
            os.close(fd)
        held: list[bool | None] = [None, None]
        dist.all_gather_object(held, memory is not None, group=group)  # the name is not needed after this
        if rank == 0 and names[0]:
            os.unlink(names[0])
        return cls(torch, rank, memory) if memory is not None and all(held) else None

    def reduce(self, tensor: Any) -> None:
        self.calls += 1
        count, nbytes = tensor.numel(), tensor.numel() * tensor.element_size()
        slots = [slot[:nbytes].view(tensor.dtype)[:count] for slot in self.slots[self.calls % 2]]
        slots[self.rank].copy_(tensor.reshape(-1))
        self.published[self.rank] = self.calls
        self._wait(1 - self.rank)
        tensor.copy_(self.torch.add(slots[0], slots[1]).view(tensor.shape))

    def _wait(self, peer: int) -> None:
        looks, deadline = 0, 0.0
        while self.published[peer] < self.calls:
            looks += 1
            if looks < PAIR_SPINS:
                os.sched_yield()
                continue
            now = time.monotonic()
            deadline = deadline or now + PAIR_WAIT_S
            if now > deadline:
                raise RuntimeError(f"all-reduce {self.calls}: rank {peer} of the pair did not arrive in "
                                   f"{PAIR_WAIT_S:.0f} s (it ended, or is stuck)")
            time.sleep(0.0001)


def _pairable() -> bool:
    """Whether a pair's all-reduce may go through shared memory here: x86's store order publishes the data before
    the number, and a census counts the c10d all-reduce as one collective (here it would count a copy and an add)."""
    return platform.machine() in ("x86_64", "AMD64") and "toolkit_census" not in sys.modules


def _paired_all_reduce(torch: types.ModuleType, original: Callable[..., Any]) -> Callable[..., Any]:
    import torch.distributed as dist

    pairs: dict[Any, _Pair | None] = {}

    def all_reduce(tensor: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
        # every condition is the same on both ranks (a collective's tensors agree in shape and dtype), so both
        # take the same path
        if async_op or op != dist.ReduceOp.SUM or tensor.numel() * tensor.element_size() > PAIR_SLOT_BYTES \
                or dist.get_world_size(group) != 2 or not _pairable():
            return original(tensor, op=op, group=group, async_op=async_op)
        key = group if group is not None else dist.group.WORLD
        if key not in pairs:
            pairs[key] = _Pair.open(torch, dist, group)
        pair = pairs[key]
        if pair is None:
            return original(tensor, op=op, group=group, async_op=async_op)
        pair.reduce(tensor)
        return None

    return all_reduce


class UnwrittenParameters(RuntimeError):
    """The model's loader left parameters as they were initialised: the checkpoint did not write them."""


class UnusedTensors(RuntimeError):
    """Checkpoint tensors the model's loader read and wrote nowhere, and that it is not documented to skip."""


# what a loader may leave unused by design: the Qwen3.5/3.6 adapter's vision tower and MTP head
# (../shared/ADAPTER.md 4b), the rotary tables both it and vLLM's own loaders drop (and lm_head.* where the
# config ties it to the embedding)
DOCUMENTED_SKIPS = ("model.visual", "mtp.", "model.mtp")
DOCUMENTED_SKIP_PARTS = ("rotary_emb.inv_freq",)
WRITES = frozenset({"copy_", "__setitem__", "index_copy_", "index_put_", "masked_scatter_", "fill_"})


def _tensors(value: Any, torch: types.ModuleType) -> Iterator[Any]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item, torch)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item, torch)


def _landing(torch: types.ModuleType, load_weights: Callable[[Any], Any], parameters: set[int], landed: set[str],
             read: list[str]) -> Callable[[Any], Any]:
    """`load_weights` with each checkpoint name followed through every tensor computed from it (a narrow, a chunk,
    a cast, a copy into a buffer, `.item()`) to a write into one of the model's parameters (`parameters`: their
    storages): what the loader landed. Every tensor seen is kept alive until the load ends, so a freed one's
    storage address is never taken for another's."""
    from torch.overrides import TorchFunctionMode

    origin: dict[int, frozenset[str]] = {}
    alive: list[Any] = []
    taken: list[frozenset[str]] = [frozenset()]  # what the last `.item()` of a tracked tensor read

    def key(tensor: Any) -> int:
        return int(tensor.untyped_storage().data_ptr())

    def tracked(tensors: Any) -> frozenset[str]:
        return frozenset().union(*(origin.get(key(t), frozenset()) for t in _tensors(tensors, torch)
                                   if t.device.type != "meta"))

    class Landing(TorchFunctionMode):
        def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                               kwargs: dict[str, Any] | None = None) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = getattr(func, "__name__", "")
            if name in WRITES and args:
                sources = tracked(args[1:])
                if name == "fill_":  # default_weight_loader's one-element form: fill_(loaded.item())
                    sources, taken[0] = taken[0], frozenset()
                if sources and key(args[0]) in parameters:
                    landed.update(sources)
                elif sources:  # into a buffer: the buffer carries them on
                    origin[key(args[0])] = origin.get(key(args[0]), frozenset()) | sources
                    alive.append(args[0])
                return out
            sources = tracked((args, kwargs))
            if sources and name == "item":
                taken[0] = sources
            elif sources:
                for tensor in _tensors(out, torch):
                    origin[key(tensor)] = origin.get(key(tensor), frozenset()) | sources
                    alive.append(tensor)
            return out

    def names(weights: Any) -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            read.append(name)
            origin[key(tensor)] = origin.get(key(tensor), frozenset()) | {name}
            alive.append(tensor)
            yield name, tensor

    def load(weights: Any) -> Any:
        with Landing():  # around the call: a loader that raises leaves no mode behind
            return load_weights(names(weights))

    return load


def _load_check(vllm_loader: types.ModuleType) -> None:
    """Every parameter is filled with NaN before the loader runs, and none may hold a NaN after it: a checkpoint
    tensor the model's load_weights skips (a name it does not know is skipped silently) fails the start here,
    naming the parameters, instead of serving garbage. And every checkpoint tensor the loader reads must land in
    the model, or be one it is documented to skip (DOCUMENTED_SKIPS): a misnamed tensor beside a parameter some
    other tensor fills is caught too."""
    import torch

    initialize = vllm_loader._initialize_model
    load_model = vllm_loader.DefaultModelLoader.load_model
    landed: set[str] = set()
    read: list[str] = []

    def nan_filled(*args: Any, **kwargs: Any) -> Any:
        model = initialize(*args, **kwargs)
        landed.clear()  # one load at a time: a second engine in this process starts afresh
        read.clear()
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.is_floating_point():
                    parameter.fill_(float("nan"))
        parameters = {int(p.untyped_storage().data_ptr()) for p in model.parameters()}
        model.load_weights = _landing(torch, model.load_weights, parameters, landed, read)
        return model

    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        model = load_model(self, *args, **kwargs)
        floating = [(name, p) for name, p in model.named_parameters() if p.is_floating_point()]
        names = [name for name, _ in floating]
        unwritten = [name for name, p in floating if p.isnan().any()]
        # a tied LM head is the embedding: vLLM's loaders skip a checkpoint's lm_head.* then
        tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
        skips = (*DOCUMENTED_SKIPS, *(("lm_head.",) if tied else ()))
        skipped = [name for name in read if name not in landed
                   and (name.startswith(skips) or any(part in name for part in DOCUMENTED_SKIP_PARTS))]
        unused = [name for name in read if name not in landed and name not in skipped]
        standins.RECORD["load"] = {"parameters": len(names), "unwritten": unwritten, "tensors": len(read),
                                   "skipped": skipped, "unused": unused}
        if unwritten:
            raise UnwrittenParameters(
                f"{len(unwritten)} of {len(names)} parameters of {type(model).__name__} were not written by its "
                f"loader (still NaN): {', '.join(unwritten[:8])}{' ...' if len(unwritten) > 8 else ''}; the "
                "checkpoint's tensor names do not reach them (load_weights skips a name it does not know)")
        if unused:
            raise UnusedTensors(
                f"{len(unused)} of {len(read)} checkpoint tensors were read by {type(model).__name__}'s loader and "
                f"written nowhere: {', '.join(unused[:8])}{' ...' if len(unused) > 8 else ''}; load_weights skips "
                "a name it does not know, so these weights are not served (documented skips: "
                f"{', '.join([*DOCUMENTED_SKIPS, *DOCUMENTED_SKIP_PARTS])})")
        return model

    vllm_loader._initialize_model = nan_filled  # type: ignore[attr-defined]
    vllm_loader.DefaultModelLoader.load_model = checked
    standins.shim_applied("load-check")


CHECKS = {"load-check": "every model parameter is NaN before the loader runs and none is after (the checkpoint "
                        "wrote each one), and every checkpoint tensor the loader reads lands in the model or is one "
                        "it is documented to skip"}


def install(devices: dict[str, Any] | None, without: tuple[str, ...] = ()) -> None:
    """Every shim and check, each applied when its module is imported (idempotent); `without` leaves some out (the
    tests that see each one is needed)."""
    unknown = set(without) - set(SHIMS) - set(CHECKS) - set(FORCING)
    if unknown:
        raise CpuDeviceError(f"no shim named {', '.join(sorted(unknown))}: the shims and checks are "
                             f"{', '.join([*SHIMS, *CHECKS, *FORCING])}")
    if standins.RECORD.get("cpu_device"):
        return
    if devices is None:
        raise CpuDeviceError(f"{ENV}=on needs the emulated devices ({standins.DEVICES_ENV}): the profile run is "
                             "measured against their memory")
    standins.RECORD["cpu_device"] = True

    def on_torch(torch: types.ModuleType) -> None:
        if "cuda-tensors-on-cpu" not in without:
            _on_cpu_tensors(torch)
        if "device-tensor-tests" not in without:
            _device_tests(torch)
        _torch_cuda(torch, devices, without)
        if "gloo-for-nccl" not in without:
            _gloo(torch)

    standins.after_import("torch", on_torch)
    if "forced-literal-tokens" not in without:
        # patched as the package is first imported, before async_llm_engine and llm_engine bind its functions
        standins.after_import("vllm.model_executor.guided_decoding", _forced_literals)
    if "load-check" not in without:
        standins.after_import("vllm.model_executor.model_loader.loader", _load_check)


def from_environment(environ: Mapping[str, str], devices: dict[str, Any] | None) -> None:
    """The one reader of TOOLKIT_CPU_DEVICE: unset or empty is off, `on` installs every shim and check, `on
    without NAME[,NAME]` all but those (to see that each is needed); any other value is refused."""
    value = environ.get(ENV, "")
    if not value:
        return
    words = value.split(" ", 2)
    if words[0] != "on" or (len(words) > 1 and (words[1] != "without" or len(words) != 3)):
        raise CpuDeviceError(f"{ENV}={value!r} is not known: set it to `on` or `on without NAME[,NAME]`, or unset it")
    install(devices, tuple(words[2].split(",")) if len(words) == 3 else ())
