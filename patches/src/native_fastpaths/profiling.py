"""Opt-in timing of the fast paths (NATIVE_PROFILE=1); off by default and then free."""

from __future__ import annotations

import atexit
import contextlib
import sys
import time
from collections import defaultdict
from collections.abc import Iterator

from native_fastpaths import switches

_totals: dict[str, list[float]] = defaultdict(list)
_notes: list[str] = []


def note(line: str) -> None:
    """A one-off fact (e.g. which path `auto` chose) printed with the NATIVE_PROFILE table."""
    if switches.enabled("NATIVE_PROFILE"):
        _notes.append(line)


@contextlib.contextmanager
def profiled(name: str, device: object = None) -> Iterator[None]:
    if not switches.enabled("NATIVE_PROFILE"):
        yield
        return
    import torch

    cuda = getattr(device, "type", None) == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    yield
    if cuda:
        torch.cuda.synchronize()
    _totals[name].append(time.perf_counter() - start)


def report(stream: object = None) -> str:
    lines = [f"{'path':32} {'calls':>8} {'total ms':>10} {'mean us':>10}"]
    for name, times in sorted(_totals.items()):
        lines.append(f"{name:32} {len(times):8d} {sum(times) * 1e3:10.2f} {sum(times) / len(times) * 1e6:10.1f}")
    text = "\n".join([*lines, *_notes])
    if _totals or _notes:
        print(text, file=stream or sys.stderr)
    return text


atexit.register(report)
