"""The device model's constants fitted on what was measured on the target: TOOLKIT_PROFILE records (`toolkit
profile`'s input) taken with TOOLKIT_PROFILE_SYNC=1, whose decode regions' time per call the counted decode step
must reproduce.

A synchronised region's time on the target is its operations' (a launch each, plus the longer of compute and memory
traffic; an all-reduce's latency and traffic) and the device synchronises inside its clock (its own end, both ends
of each timed region within it): the profiler's own cost, `sync_us`, fitted with the rest and left out of every
prediction of an unprofiled run. A timer the records leave out (section 2's "MoE routed experts", which no probe
names) still synchronised there: its cost falls to the regions around it. Fitted: the launch cost, the achieved
fraction of bandwidth, the all-reduce latency and the synchronise; the achieved fraction of peak compute is a stated
prior (a decode step is launch- and memory-bound: no decode region tells it).

The fit minimises the squared log ratio of predicted to measured time per call over the regions both sides have
(coordinate descent in log space: four constants, a few hundred evaluations). The calibration file keeps the
constants, what they were fitted on and each region's measured and fitted time; its spread (the largest ratio
between them) is the range the estimate gives its predictions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from toolkit.errors import ToolkitError
from toolkit.estimate.count import CountedStep, within
from toolkit.estimate.device import Calibration, Device
from toolkit.estimate.predict import inclusive, regions

COMPUTE_FRACTION = 0.5  # the prior: bf16 GEMMs of these shapes on a 2020s accelerator reach about half its peak
BUCKET = "decode"
FITTED = ("launch_us", "bandwidth_fraction", "all_reduce_us", "sync_us")
BOUNDS = {"launch_us": (0.1, 1000.0), "bandwidth_fraction": (0.01, 1.0), "all_reduce_us": (0.1, 10_000.0),
          "sync_us": (0.0, 10_000.0)}


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

    @property
    def spread(self) -> float:
        """The largest ratio between a region's fitted and measured time (>= 1): the predictions' range factor."""
        ratios = [max(r["fitted_ms"] / r["measured_ms"], r["measured_ms"] / r["fitted_ms"])
                  for r in self.regions.values() if r["measured_ms"] > 0 and r["fitted_ms"] > 0]
        return max(ratios, default=1.0)

    def as_yaml(self) -> str:
        data = {**asdict(self.calibration), "sync_us": self.sync_us, "fitted_on": self.fitted_on,
                "regions": self.regions}
        return ("# toolkit estimate's device model constants (docs/estimate.md); refit with\n"
                "# `toolkit estimate RECIPE --calibrate DIR` on TOOLKIT_PROFILE_SYNC=1 records from the target\n"
                + yaml.safe_dump(data, sort_keys=False))


def read(path: Path) -> Fitted:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ToolkitError(f"calibration file {path} does not exist",
                           hint="`toolkit estimate RECIPE --calibrate DIR` writes one from the target's profile "
                           "records; estimate.calibration names it, relative to the recipe") from None
    except yaml.YAMLError as exc:
        raise ToolkitError(f"calibration file {path} is not YAML: {exc}") from None
    keys = ("launch_us", "bandwidth_fraction", "compute_fraction", "all_reduce_us")
    missing = [k for k in (*keys, "sync_us") if not isinstance(data, dict) or k not in data]
    if missing:
        raise ToolkitError(f"calibration file {path} lacks {', '.join(missing)}",
                           hint="refit it: `toolkit estimate RECIPE --calibrate DIR`")
    try:
        calibration = Calibration(**{k: float(data[k]) for k in keys})
    except (TypeError, ValueError) as exc:
        raise ToolkitError(f"calibration file {path}: {exc}") from None
    return Fitted(calibration, float(data["sync_us"]), str(data.get("fitted_on", "")),
                  {k: dict(v) for k, v in (data.get("regions") or {}).items()})


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
        rounds: int = 60) -> Fitted:
    """The constants that make the counted decode step reproduce `targets` best (see the module)."""
    usable = [t for t in targets if entries.get(t.region) and t.per_call_ms > 0]
    if len(usable) < len(FITTED):
        names = ", ".join(t.region for t in targets[:8])
        raise ToolkitError(f"{len(usable)} measured region(s) match the counted step's regions, fewer than the "
                           f"{len(FITTED)} constants to fit (measured: {names})",
                           hint="the records' region names must be the recipe's probe regions (its probes layer)")
    values = {"launch_us": 20.0, "bandwidth_fraction": 0.5, "all_reduce_us": 50.0, "sync_us": 20.0}
    timed = frozenset(t.region for t in targets)
    regions_fitted = [t.region for t in usable]

    def loss(v: dict[str, float]) -> float:
        calibration = Calibration(v["launch_us"], v["bandwidth_fraction"], COMPUTE_FRACTION, v["all_reduce_us"])
        predicted = _predicted(step, entries, device, calibration, v["sync_us"], regions_fitted, timed)
        return sum(math.log(max(predicted[t.region] * 1e3, 1e-9) / t.per_call_ms) ** 2 for t in usable)

    values = _descend(loss, values, rounds)
    calibration = Calibration(values["launch_us"], values["bandwidth_fraction"], COMPUTE_FRACTION,
                              values["all_reduce_us"])
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
    return {**asdict(fitted.calibration), "sync_us": fitted.sync_us, "fitted_on": fitted.fitted_on,
            "spread": fitted.spread, "regions": fitted.regions}
