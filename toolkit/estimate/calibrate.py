"""The device model's constants fitted on what was measured on the target: TOOLKIT_PROFILE records (`toolkit
profile`'s input) taken with TOOLKIT_PROFILE_SYNC=1, whose decode regions' time per call the counted decode step
must reproduce.

A synchronised region's time on the target is its operations' (a launch each, plus the longer of compute and memory
traffic; an all-reduce's latency and traffic) and the device synchronises inside its clock (its own end, both ends
of each timed region within it): the profiler's own cost, `sync_us`, fitted with the rest and left out of every
prediction of an unprofiled run. A timer the records leave out (section 2's "MoE routed experts", which no probe
names) still synchronised there: its cost falls to the regions around it. Fitted: the launch cost, the achieved
fraction of bandwidth and the synchronise; the achieved fraction of peak compute is a stated prior (a decode step is
launch- and memory-bound: no decode region tells it). A fitted constant that ends at a bound of its range was not
identified by the records: the calibration says so (`Fitted.unidentified`), and so does every estimate using it.

The all-reduce is not fitted on the regions (the profiler's synchronise swallows its latency): each implementation's
latency and rate are decided by its device-timed calls at two buffer sizes (`timings`, from a file of the target's
timings: the smallest and the largest buffer), and its calls at every other size are predictions, kept beside them.
The same file's decode rates against the context decide `DecodeContext`'s two lines (the figures it names under
`decides`, two on each side of the path's change); its other figures are predictions.

The fit minimises the squared log ratio of predicted to measured time per call over the regions both sides have
(coordinate descent in log space: four constants, a few hundred evaluations). The calibration file keeps the
constants, what they were fitted on and each region's measured and fitted time; its spread (the largest ratio
between them) is the range the estimate gives its predictions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from toolkit.errors import ToolkitError
from toolkit.estimate.count import CountedStep, within
from toolkit.estimate.device import ALL_REDUCES, AllReduce, Calibration, DecodeContext, Device
from toolkit.estimate.predict import inclusive, regions

COMPUTE_FRACTION = 0.5  # the prior: bf16 GEMMs of these shapes on a 2020s accelerator reach about half its peak
BUCKET = "decode"
FITTED = ("launch_us", "bandwidth_fraction", "sync_us")
BOUNDS = {"launch_us": (0.1, 1000.0), "bandwidth_fraction": (0.01, 1.0), "sync_us": (0.0, 10_000.0)}


@dataclass(frozen=True)
class Measured:
    """One region's time per call on the target (decode bucket, synchronised)."""

    region: str
    per_call_ms: float
    calls: float


@dataclass
class Fitted:
    """A calibration as its file holds it."""

    calibration: Calibration
    sync_us: float
    fitted_on: str
    regions: dict[str, dict[str, float]] = field(default_factory=dict)  # region -> measured_ms, fitted_ms
    # what the census it was fitted with served: variant, adapter (its source's commit), dtype, all_reduce
    fitted_with: dict[str, str] = field(default_factory=dict)
    # what decided the timings' constants and what they predict: {"all_reduce": {IMPLEMENTATION: ...},
    # "decode_context": ...}
    checks: dict[str, Any] = field(default_factory=dict)

    @property
    def unidentified(self) -> list[str]:
        """The fitted constants that ended at a bound of their range: the records did not decide them."""
        values = {**asdict(self.calibration), "sync_us": self.sync_us}
        # a lower bound of 0 is a value the fit may find (no cost at all), not a wall it stopped at
        return [name for name in FITTED if values[name] in {b for b in BOUNDS[name] if b != 0.0}]

    @property
    def spread(self) -> float:
        """The largest ratio between a region's fitted and measured time (>= 1): the predictions' range factor."""
        ratios = [max(r["fitted_ms"] / r["measured_ms"], r["measured_ms"] / r["fitted_ms"])
                  for r in self.regions.values() if r["measured_ms"] > 0 and r["fitted_ms"] > 0]
        return max(ratios, default=1.0)

    def as_yaml(self) -> str:
        return ("# toolkit estimate's device model constants (docs/estimate.md); refit with `toolkit estimate RECIPE\n"
                "# --calibrate DIR --timings FILE` on TOOLKIT_PROFILE_SYNC=1 records and all-reduce calls timed on\n"
                "# the target\n" + yaml.safe_dump(to_json(self), sort_keys=False))


def _yaml(path: Path, what: str, absent: str) -> Any:
    """A YAML file's data, or a ToolkitError naming `what` it is and, when it is missing, where one comes from."""
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ToolkitError(f"{what} {path} does not exist", hint=absent) from None
    except yaml.YAMLError as exc:
        raise ToolkitError(f"{what} {path} is not YAML: {exc}") from None


def read(path: Path) -> Fitted:
    data = _yaml(path, "calibration file", "`toolkit estimate RECIPE --calibrate DIR --timings FILE` writes one from "
                 "the target's records; estimate.calibration names it, relative to the recipe")
    keys = ("launch_us", "bandwidth_fraction", "compute_fraction")
    missing = [k for k in (*keys, "sync_us", "all_reduce") if not isinstance(data, dict) or k not in data]
    if missing:
        older = " (a calibration from before the all-reduce was priced per implementation)" \
            if isinstance(data, dict) and "all_reduce_us" in data else ""
        raise ToolkitError(f"calibration file {path} lacks {', '.join(missing)}{older}",
                           hint="refit it: `toolkit estimate RECIPE --calibrate DIR --timings FILE --write NEW`")
    try:
        reduces = {name: AllReduce(float(v["latency_us"]), float(v["gbs"])) for name, v in data["all_reduce"].items()}
        calibration = Calibration(float(data["launch_us"]), float(data["bandwidth_fraction"]),
                                  float(data["compute_fraction"]), reduces)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ToolkitError(f"calibration file {path}: {exc!r}",
                           hint="all_reduce: {IMPLEMENTATION: {latency_us: N, gbs: N}} per implementation") from None
    checks: dict[str, Any] = {"all_reduce": {name: {k: v for k, v in entry.items() if k not in ("latency_us", "gbs")}
                                             for name, entry in data["all_reduce"].items()}}
    context = data.get("decode_context")
    if context:
        try:
            (b0, b1), (a0, a1) = (map(float, context[side]) for side in ("below", "above"))
            decode = DecodeContext(int(context["path_above"]), (b0, b1), (a0, a1))
        except (TypeError, ValueError, KeyError) as exc:
            raise ToolkitError(f"calibration file {path}: decode_context: {exc!r}",
                               hint="decode_context: {path_above: N, below: [S, S_PER_TOKEN], above: [...]}") from None
        calibration = dataclasses.replace(calibration, decode_context=decode)
        checks["decode_context"] = {k: v for k, v in context.items() if k not in ("path_above", "below", "above")}
    return Fitted(calibration, float(data["sync_us"]), str(data.get("fitted_on", "")),
                  {k: dict(v) for k, v in (data.get("regions") or {}).items()},
                  {k: str(v) for k, v in (data.get("fitted_with") or {}).items()}, checks)


def timings(path: Path, ranks: int) -> tuple[dict[str, AllReduce], DecodeContext | None, dict[str, Any]]:
    """The all-reduce per implementation and the decode against its context, decided by the target's timings in
    `path` (see the module), and the checks of what they predict: {"all_reduce": {IMPLEMENTATION: ...},
    "decode_context": ...}. `ranks` must be the ranks they were timed at (a ring's traffic depends on it)."""
    data = _yaml(path, "timings file", "benchmarks/data/target-timings.yaml holds the target's "
                 "(TARGET_MEASUREMENTS.md section 4)")
    try:
        timed_ranks, element = int(data["ranks"]), int(data["element_bytes"])
        measured = {str(name): {int(n): float(ms) for n, ms in calls.items()}
                    for name, calls in data["all_reduce"].items()}
        context = data.get("decode_context")
        rates = {int(c): float(v) for c, v in context["measured"].items()} if context else {}
        decides = [int(c) for c in context["decides"]] if context else []
        path_above = int(context["path_above"]) if context else 0
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ToolkitError(f"timings file {path}: {exc!r}", hint="ranks: N, element_bytes: N, all_reduce: "
                           "{IMPLEMENTATION: {ELEMENTS: MS}}, decode_context: {path_above: N, measured: "
                           "{CONTEXT: TOK_S}, decides: [CONTEXT, ...]}") from None
    if timed_ranks != ranks:
        raise ToolkitError(f"timings file {path} was timed at {timed_ranks} ranks, the estimate runs {ranks}",
                           hint="time the calls at the served tensor-parallel size")
    reduces, checks = {}, {}
    ring = 2 * (ranks - 1) / ranks
    for name, calls in measured.items():
        if name not in ALL_REDUCES:
            raise ToolkitError(f"timings file {path}: all_reduce {name} is not one of {', '.join(ALL_REDUCES)}")
        sizes = sorted(calls)
        if len(sizes) < 2 or calls[sizes[-1]] <= calls[sizes[0]]:
            raise ToolkitError(f"timings file {path}: all_reduce {name} needs two buffer sizes, the larger one "
                               "slower, to decide a latency and a rate")
        small, large = sizes[0], sizes[-1]
        seconds_per_byte = (calls[large] - calls[small]) * 1e-3 / (ring * (large - small) * element)
        latency = calls[small] * 1e-3 - seconds_per_byte * ring * small * element
        reduce = AllReduce(max(latency, 0.0) * 1e6, 1e-9 / seconds_per_byte)
        reduces[name] = reduce
        predicted = {str(n): {"measured_ms": calls[n],
                              "predicted_ms": round((reduce.latency_us * 1e-6 + ring * n * element * seconds_per_byte)
                                                    * 1e3, 4)} for n in sizes[1:-1]}
        checks[name] = {"decided_by": f"{path.name}: {small} and {large} elements", "predicted": predicted}
    out: dict[str, Any] = {"all_reduce": checks}
    if not rates:
        return reduces, None, out
    lines = []
    for side in (sorted(c for c in decides if c < path_above), sorted(c for c in decides if c >= path_above)):
        if len(side) != 2 or any(c not in rates for c in side):
            raise ToolkitError(f"timings file {path}: decode_context decides by two measured contexts on each side "
                               f"of {path_above}, not {', '.join(map(str, decides))}")
        (c0, r0), (c1, r1) = ((c, rates[c]) for c in side)
        slope = (1 / r1 - 1 / r0) / (c1 - c0)
        lines.append((1 / r0 - slope * c0, slope))
    decode = DecodeContext(path_above, lines[0], lines[1])
    out["decode_context"] = {
        "decided_by": f"{path.name}: tok/s at " + ", ".join(f"{c:,}" for c in sorted(decides)),
        "predicted": {str(c): {"measured_tok_s": rates[c], "predicted_tok_s": round(1 / decode.seconds(c), 3)}
                      for c in sorted(rates) if c not in decides}}
    return reduces, decode, out


def measured(records: Path) -> list[Measured]:
    """The decode regions' time per call in TOOLKIT_PROFILE records, the mean over the ranks that recorded each."""
    from toolkit.bench.profile import load, tables

    processes = load([records])
    if not any(p.sync for p in processes):
        raise ToolkitError(f"{records}: the records were taken without TOOLKIT_PROFILE_SYNC=1: a region's time is "
                           "then the host's alone, which the device model cannot be fitted on",
                           hint="profile on the target with TOOLKIT_PROFILE=1 TOOLKIT_PROFILE_SYNC=1")
    rows = tables(processes).get(BUCKET, [])
    if not rows:
        raise ToolkitError(f"{records}: no {BUCKET} regions recorded", hint="profile a run that decodes")
    return [Measured(r["region"], r["mean_ms"], r["calls"]) for r in rows if r["calls"]]


def _predicted(step: CountedStep, entries: dict[str, float], device: Device, calibration: Calibration,
               sync_us: float, targets: list[str], timed: frozenset[str]) -> dict[str, float]:
    """Each target region's synchronised time per call, predicted from the counted decode step: its operations, and
    the synchronises its clock sees: its own at its end (the one at its start runs before the clock), and both of
    each entry of a region the records timed (`timed`) inside it."""
    own = regions(step.ranks[min(step.ranks)], device, calibration)
    out = {}
    for region in targets:
        calls = entries.get(region)
        if not calls:
            out[region] = math.nan
            continue
        inside = sum(n for name, n in entries.items() if name in timed and name != region and within(name, region))
        out[region] = (inclusive(own, region) + sync_us * 1e-6 * (calls + 2 * inside)) / calls
    return out


def fit(step: CountedStep, entries: dict[str, float], device: Device, targets: list[Measured], fitted_on: str,
        reduces: dict[str, AllReduce], decode_context: DecodeContext | None = None, rounds: int = 60) -> Fitted:
    """The constants that make the counted decode step reproduce `targets` best (see the module)."""
    usable = [t for t in targets if entries.get(t.region) and t.per_call_ms > 0]
    if len(usable) < len(FITTED):
        names = ", ".join(t.region for t in targets[:8])
        raise ToolkitError(f"{len(usable)} measured region(s) match the counted step's regions, fewer than the "
                           f"{len(FITTED)} constants to fit (measured: {names})",
                           hint="the records' region names must be the recipe's probe regions (its probes layer)")
    values = {"launch_us": 20.0, "bandwidth_fraction": 0.5, "sync_us": 20.0}
    timed = frozenset(t.region for t in targets)
    regions_fitted = [t.region for t in usable]

    def loss(v: dict[str, float]) -> float:
        calibration = Calibration(v["launch_us"], v["bandwidth_fraction"], COMPUTE_FRACTION, reduces)
        predicted = _predicted(step, entries, device, calibration, v["sync_us"], regions_fitted, timed)
        return sum(math.log(max(predicted[t.region] * 1e3, 1e-9) / t.per_call_ms) ** 2 for t in usable)

    values = _descend(loss, values, rounds)
    calibration = Calibration(values["launch_us"], values["bandwidth_fraction"], COMPUTE_FRACTION, reduces,
                              decode_context)
    fitted = _predicted(step, entries, device, calibration, values["sync_us"], regions_fitted, timed)
    table = {t.region: {"measured_ms": round(t.per_call_ms, 4), "fitted_ms": round(fitted[t.region] * 1e3, 4)}
             for t in usable}
    return Fitted(calibration, values["sync_us"], fitted_on, table)


def _descend(loss: Callable[[dict[str, float]], float], start: dict[str, float], rounds: int) -> dict[str, float]:
    """Coordinate descent: each constant in turn scaled up or down by a factor that halves (in log) when neither
    helps; a constant whose lower bound is 0 also tries 0."""
    values, best = dict(start), loss(start)
    factors = dict.fromkeys(FITTED, 4.0)
    for _ in range(rounds):
        for name in FITTED:
            low, high = BOUNDS[name]
            base = values[name] or start[name]  # a constant at 0 starts again from where it started
            candidates = [base * factors[name], base / factors[name]] + ([0.0] if low == 0 else [])
            improved = False
            for candidate in candidates:
                trial = {**values, name: min(max(candidate, low), high)}
                score = loss(trial)
                if score < best - 1e-12:
                    values, best, improved = trial, score, True
            if not improved:
                factors[name] = math.sqrt(factors[name])
        if all(f < 1.0005 for f in factors.values()):
            break
    return values


def calibration_path(recipe_file: Path, named: str) -> Path:
    return (recipe_file.parent / named).resolve()


def to_json(fitted: Fitted) -> dict[str, Any]:
    c = fitted.calibration
    reduces = {name: {"latency_us": round(r.latency_us, 4), "gbs": round(r.gbs, 4),
                      **fitted.checks.get("all_reduce", {}).get(name, {})} for name, r in c.all_reduce.items()}
    context = {} if c.decode_context is None else {"decode_context": {
        "path_above": c.decode_context.path_above, "below": list(c.decode_context.below),
        "above": list(c.decode_context.above), **fitted.checks.get("decode_context", {})}}
    return {"launch_us": c.launch_us, "bandwidth_fraction": c.bandwidth_fraction,
            "compute_fraction": c.compute_fraction, "sync_us": fitted.sync_us, "all_reduce": reduces, **context,
            "fitted_on": fitted.fitted_on, "fitted_with": fitted.fitted_with, "unidentified": fitted.unidentified,
            "spread": fitted.spread, "regions": fitted.regions}
