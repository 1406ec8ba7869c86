"""Where the time goes, when asked (TOOLKIT_PROFILE=1): named regions timed per bucket, written per process.

The `probe` transforms put `with _toolkit_profile.region(...) if _toolkit_profile.ON else _toolkit_profile.OFF:`
around vendor and adapter code, and `_toolkit_profile.timed(...)` around calls; the native fast paths time their own
paths with `profiled`. All of them land in one table per process: (bucket, region) -> calls, total ns, max ns.

Switches, read once when this module is imported through native_fastpaths.switches (strict: `TOOLKIT_PROFILE=true`
raises; a server restart with new env needs no rebuild):
- TOOLKIT_PROFILE=1 turns it on; off, a probed region costs one global read and a null context, no clock is read.
- TOOLKIT_PROFILE_SYNC=1 synchronises the device before a region starts and before it ends, so GPU work is
  attributed to the region that queued it (slower: profiled runs are for attribution, never for scores).
- TOOLKIT_PROFILE_EVERY=N writes a summary every N calls of an outermost region (0: only at exit); worker
  processes that are killed instead of exiting keep what their last summary wrote.
- TOOLKIT_PROFILE_DIR=DIR is where each process appends JSON lines to profile-<pid>.jsonl (default:
  $TMPDIR/toolkit-profile): one line per (bucket, region) and summary, with pid, TP rank when known, calls, total_ns
  and max_ns; the summaries are cumulative, `toolkit profile` reads each process's last one.
On CUDA each region is also an NVTX range, so Nsight Systems shows the same names.

A region's bucket is the bucket of the region it runs inside; an outermost region takes its own rule: a token count
(an int, or a tensor's first dimension) against upper bounds in order (default: up to 1 token is decode, more is
prefill), or a fixed bucket name; with neither, "all".

Standard library (and its package's switches) only at import (torch is imported on first use when on): the vendor
module that imports this one must import everywhere the image does.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from native_fastpaths import switches

ENV = "TOOLKIT_PROFILE"
DEFAULT_BUCKETS: tuple[tuple[str, int | None], ...] = (("decode", 1), ("prefill", None))


ON = switches.on(ENV)
SYNC = switches.on("TOOLKIT_PROFILE_SYNC")
EVERY = switches.count("TOOLKIT_PROFILE_EVERY")
DIR = switches.value("TOOLKIT_PROFILE_DIR") or os.path.join(tempfile.gettempdir(), "toolkit-profile")
OFF = contextlib.nullcontext()

# (bucket, region) -> [calls, total_ns, max_ns]
_stats: dict[tuple[str, str], list[int]] = {}
_stack: list[tuple[str, str]] = []  # (bucket, region) of the regions running now, innermost last
_notes: list[str] = []
_outermost_calls = 0
_summaries = 0
# (enter, leave) called as an outermost region starts and ends: a census counting what runs inside each step
_watchers: list[tuple[Callable[[], None], Callable[[], None]]] = []
_device: Any = None  # torch.cuda when it is there and on (sync, NVTX); False when not


def _cuda() -> Any:
    global _device
    if _device is None:
        _device = False
        with contextlib.suppress(Exception):
            import torch

            if torch.cuda.is_available():
                _device = torch.cuda
    return _device


def _tokens(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    shape = getattr(value, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else None
    with contextlib.suppress(TypeError):
        return len(value)
    return None


def bucket_of(tokens: Any = None, buckets: tuple[tuple[str, int | None], ...] | None = None,
              bucket: str | None = None) -> str:
    """The bucket a region starts in: its enclosing region's, else its own rule's."""
    if _stack:
        return _stack[-1][0]
    if bucket is not None:
        return bucket
    count = _tokens(tokens) if tokens is not None else None
    if count is None:
        return "all"
    for name, upper in buckets or DEFAULT_BUCKETS:
        if upper is None or count <= upper:
            return name
    return (buckets or DEFAULT_BUCKETS)[-1][0]


def _timed_region(name: str, tokens: Any, buckets: tuple[tuple[str, int | None], ...] | None,
                  bucket: str | None) -> contextlib.AbstractContextManager[None]:
    # a region entered again inside itself (a dispatch that calls the probed function's own body, recursion) is
    # already being timed: counting it twice would make a child outgrow its parent
    if any(active == name for _, active in _stack):
        return OFF
    return _Timing(name, tokens, buckets, bucket)


class _Timing:
    """One timed entry of a region (a class, not a generator: entering and leaving cost half as much)."""

    __slots__ = ("cuda", "name", "start", "where")

    def __init__(self, name: str, tokens: Any, buckets: tuple[tuple[str, int | None], ...] | None,
                 bucket: str | None) -> None:
        self.name = name
        self.where = bucket_of(tokens, buckets, bucket)
        self.cuda = _cuda()

    def __enter__(self) -> None:
        if self.cuda:
            if SYNC:
                self.cuda.synchronize()
            self.cuda.nvtx.range_push(f"{self.where}.{self.name}")
        _stack.append((self.where, self.name))
        if len(_stack) == 1:
            for enter, _ in _watchers:
                enter()
        self.start = time.perf_counter_ns()

    def __exit__(self, *exc: object) -> None:
        if self.cuda and SYNC:
            self.cuda.synchronize()
        elapsed = time.perf_counter_ns() - self.start
        if len(_stack) == 1:
            for _, leave in _watchers:
                leave()
        _stack.pop()
        if self.cuda:
            self.cuda.nvtx.range_pop()
        entry = _stats.get((self.where, self.name))
        if entry is None:
            _stats[(self.where, self.name)] = [1, elapsed, elapsed]
        else:
            entry[0] += 1
            entry[1] += elapsed
            if elapsed > entry[2]:
                entry[2] = elapsed
        if not _stack:
            _outermost_done()


def region(name: str, tokens: Any = None, buckets: tuple[tuple[str, int | None], ...] | None = None,
           bucket: str | None = None) -> contextlib.AbstractContextManager[None]:
    """Time the block under `name` (dotted: `step.forward.moe` nests under `step.forward`)."""
    if not ON:
        return OFF
    return _timed_region(name, tokens, buckets, bucket)


def timed(name: str, fn: Callable[..., Any], tokens: Any = None,
          buckets: tuple[tuple[str, int | None], ...] | None = None, bucket: str | None = None) -> Callable[..., Any]:
    """`fn` itself when off; on, a callable that runs it inside region `name`."""
    if not ON:
        return fn

    def call(*args: Any, **kwargs: Any) -> Any:
        with _timed_region(name, tokens, buckets, bucket):
            return fn(*args, **kwargs)

    return call


def _locator(fn: Callable[..., Any], tokens: str) -> Callable[[tuple[Any, ...], dict[str, Any]], Any]:
    """Where a whole-function probe finds its token count: a parameter, or an attribute path from one."""
    import inspect

    head, *path = tokens.split(".")
    params = list(inspect.signature(fn).parameters.values())
    index = next((i for i, p in enumerate(params) if p.name == head), None)
    if index is None:
        raise ValueError(f"probe tokens {tokens!r}: {fn.__qualname__} has no parameter {head!r}")
    default = params[index].default

    def locate(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        value = kwargs[head] if head in kwargs else args[index] if index < len(args) else default
        for attr in path:
            value = getattr(value, attr, None)
        return value

    return locate


def probe(name: str, tokens: str | None = None, buckets: tuple[tuple[str, int | None], ...] | None = None,
          bucket: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator timing the whole function as region `name`; off, it returns the function itself."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        if not ON:
            return fn
        import functools

        locate = _locator(fn, tokens) if tokens else None

        @functools.wraps(fn)
        def probed(*args: Any, **kwargs: Any) -> Any:
            with _timed_region(name, locate(args, kwargs) if locate else None, buckets, bucket):
                return fn(*args, **kwargs)

        return probed

    return decorate


def profiled(name: str, device: object = None) -> contextlib.AbstractContextManager[None]:
    """A native fast path's own region: under the region it runs in (`<region>.native_moe_gemm` for `moe.gemm`),
    so the table nests it there; `native.<name>` when it runs outside every probe."""
    if not ON:
        return OFF
    inside = f"{_stack[-1][1]}.native_{name.replace('.', '_')}" if _stack else f"native.{name}"
    return _timed_region(inside, None, None, None)


def current() -> tuple[str, str] | None:
    """The (bucket, region) running now, the innermost; None outside every region."""
    return _stack[-1] if _stack else None


def watch(enter: Callable[[], None], leave: Callable[[], None]) -> None:
    """Call `enter` as each outermost region starts (inside it: `current()` names it) and `leave` as it ends (still
    inside it), in this process; nothing is called while profiling is off."""
    _watchers.append((enter, leave))


def note(line: str) -> None:
    """A one-off fact (e.g. which path `auto` chose), written with the summaries."""
    if ON:
        _notes.append(line)


def regions() -> set[str]:
    """The regions recorded so far in this process (any bucket)."""
    return {name for _, name in _stats}


def native_paths() -> set[str]:
    """The native fast paths that ran (`moe.gemm`, `norm.gated`...), wherever they were timed."""
    out = set()
    for _, name in _stats:
        if name.startswith("native."):
            out.add(name.removeprefix("native."))
        elif ".native_" in name:
            out.add(name.rsplit(".native_", 1)[1].replace("_", ".", 1))
    return out


def reset() -> None:
    _stats.clear()
    _notes.clear()


def _rank() -> int | None:
    torch_dist = sys.modules.get("torch.distributed")
    with contextlib.suppress(Exception):
        if torch_dist is not None and torch_dist.is_initialized():
            return int(torch_dist.get_rank())
    for key in ("RANK", "LOCAL_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return None


def _outermost_done() -> None:
    global _outermost_calls
    _outermost_calls += 1
    if EVERY and _outermost_calls % EVERY == 0:
        write_summary(final=False)


def write_summary(final: bool) -> str | None:
    """Append this process's cumulative table to DIR/profile-<pid>.jsonl; the file's path, or None if empty."""
    global _summaries
    if not _stats and not _notes:
        return None
    _summaries += 1
    pid, rank = os.getpid(), _rank()
    # every line says how many lines its summary has: a reader knows a summary cut off by a kill from a whole one
    head = {"pid": pid, "rank": rank, "summary": _summaries, "lines": len(_stats) + len(_notes), "final": final,
            "sync": SYNC, "unix": time.time()}
    lines = [json.dumps({**head, "bucket": bucket, "region": name, "calls": calls, "total_ns": total,
                         "max_ns": longest}, sort_keys=True)
             for (bucket, name), (calls, total, longest) in sorted(_stats.items())]
    lines += [json.dumps({**head, "note": text}, sort_keys=True) for text in _notes]
    os.makedirs(DIR, exist_ok=True)
    path = os.path.join(DIR, f"profile-{pid}.jsonl")
    with open(path, "a", encoding="utf-8") as out:
        out.write("\n".join(lines) + "\n")
    return path


def _at_exit() -> None:
    if ON:
        with contextlib.suppress(OSError):
            path = write_summary(final=True)
            if path:
                print(f"[toolkit profile] {len(_stats)} region(s) written to {path}", file=sys.stderr)


atexit.register(_at_exit)
