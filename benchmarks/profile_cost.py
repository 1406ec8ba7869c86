"""What a probed region costs, off (the default) and on, per call, against the same code unprobed, in one run.

The three shapes the `probe` kind writes, exactly as it writes them (a decorator; `with region(...) if ON else
OFF:` around statements; `timed(name, fn)(args)` around a call), around a function that does nearly nothing, so the
difference is the probe's own cost. Off, the decorator returns the function itself; the other two read a global.
On, every call reads the clock twice and updates the table (TOOLKIT_PROFILE_SYNC is not measured: it waits for the
device, which is the point of it). Then the whole-step view: the flagship's probes around one step at the real
model's count of probed calls per decode step (the flagship's probes over 40 layers, below).

    python benchmarks/profile_cost.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "patches" / "src"))
from native_fastpaths import profiling as _toolkit_profile  # noqa: E402

CALLS = 200_000
PROBED_CALLS_PER_DECODE_STEP = (
    5  # the step and its four phases
    + 40 * 3  # every decoder layer, its input norm and its post-attention norm
    + 30 * 2  # GatedDeltaNet and its gated norm, in 30 layers
    + 10 * 10  # full attention, its 8 calls and the vendor backend, in 10 layers
    + 40 * 7  # the MoE block, router, routed, the shared expert's 3 and the all-reduce, in 40 layers
)


def work(x: Any) -> Any:
    return x


def shapes() -> dict[str, Callable[[Any], Any]]:
    """The probed forms, built now: the decorator is applied with the switch as it is at this moment."""

    @_toolkit_profile.probe("bench.decorated", tokens="x")
    def decorated(x: Any) -> Any:
        return x

    def statements(x: Any) -> Any:
        with _toolkit_profile.region("bench.statements", x) if _toolkit_profile.ON else _toolkit_profile.OFF:
            y = x
        return y

    def calls(x: Any) -> Any:
        return _toolkit_profile.timed("bench.calls", work)(x)

    return {"decorator": decorated, "statements": statements, "calls": calls}


def per_call_ns(fn: Callable[[Any], Any], repeats: int = 7) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(CALLS):
            fn(1)
        samples.append((time.perf_counter_ns() - start) / CALLS)
    return statistics.median(samples)


def main() -> None:
    _toolkit_profile.DIR = tempfile.mkdtemp(prefix="profile-cost-")  # on: nothing lands in the real default
    baseline = per_call_ns(work)
    print(f"unprobed call: {baseline:.0f} ns (the baseline of this run, {CALLS} calls x 7, median)")
    print(f"{'shape':12} {'off ns':>8} {'off extra':>10} {'on ns':>8} {'on extra':>9}")
    extra: dict[bool, dict[str, float]] = {False: {}, True: {}}
    for on in (False, True):
        _toolkit_profile.ON = on
        for name, fn in shapes().items():
            extra[on][name] = per_call_ns(fn) - baseline
    for name in extra[False]:
        off, on_ = extra[False][name], extra[True][name]
        print(f"{name:12} {baseline + off:8.0f} {off:+10.0f} {baseline + on_:8.0f} {on_:+9.0f}")
    worst_off = max(extra[False].values())
    worst_on = max(extra[True].values())
    step_ms = 145.0  # the seed's decode step on the target (issue 21: where its 145 ms go)
    for label, cost in (("off", worst_off), ("on", worst_on)):
        per_step_ms = PROBED_CALLS_PER_DECODE_STEP * max(cost, 0.0) / 1e6
        print(f"{label}: {PROBED_CALLS_PER_DECODE_STEP} probed calls per decode step x {max(cost, 0.0):.0f} ns "
              f"(worst shape) = {per_step_ms:.3f} ms, {per_step_ms / step_ms * 100:.3f}% of a {step_ms:.0f} ms step")
    _toolkit_profile.ON = False


if __name__ == "__main__":
    main()
