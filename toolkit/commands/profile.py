"""`toolkit profile` and `profile compare`: the merged TOOLKIT_PROFILE tables (toolkit.bench.profile) as
reports."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.bench.profile import COLUMNS, Process, load, plot, rows_of, tables
from toolkit.errors import ToolkitError
from toolkit.results import Report


def _notes(processes: list[Process]) -> list[str]:
    ranks = sorted({p.rank for p in processes if p.rank is not None})
    notes = [f"{len(processes)} process(es)" + (f", TP ranks {', '.join(map(str, ranks))}" if ranks else "")
             + "; each row is the mean over the processes that recorded the region"]
    if any(p.sync for p in processes):
        notes.append("TOOLKIT_PROFILE_SYNC=1: device time attributed to regions; the run was slower than an "
                     "unprofiled one (never a score)")
    else:
        notes.append("without TOOLKIT_PROFILE_SYNC=1 a region's time on a GPU is the host's (kernels queued, not "
                     "finished); set it for attribution")
    unfinished = [Path(p.source).name for p in processes if not p.final]
    if unfinished:
        notes.append("no final summary (the process was killed or is running): "
                     + ", ".join(unfinished) + "; its last periodic summary is used")
    for p in processes:
        notes += [f"{Path(p.source).name}: {n}" for n in p.notes]
    return notes


@dataclass(frozen=True)
class ProfileRequest:
    paths: tuple[Path, ...]
    plot: Path | None = None


def profile(request: ProfileRequest) -> Report:
    processes = load(list(request.paths))
    buckets = tables(processes)
    notes = _notes(processes)
    if request.plot is not None:
        if request.plot.exists():
            raise ToolkitError(f"--plot {request.plot} exists; nothing was written",
                               hint="give a new file (a profile plot never replaces one)")
        notes.append(plot(buckets, request.plot))
    json_buckets = {b: [{k: v for k, v in r.items() if k != "depth"} for r in rows] for b, rows in buckets.items()}
    return Report("profile", ", ".join(map(str, request.paths)), columns=COLUMNS, rows=tuple(rows_of(buckets)),
                  notes=tuple(notes), extra={"buckets": json_buckets})


def compare(a: Path, b: Path) -> Report:
    """Two profiles side by side: per bucket and region, total and per-call ms, and B / A."""
    left, right = tables(load([a])), tables(load([b]))
    rows: list[tuple[str, ...]] = []
    data: dict[str, list[dict[str, Any]]] = {}
    for bucket in dict.fromkeys([*left, *right]):
        l_rows = {r["region"]: r for r in left.get(bucket, [])}
        r_rows = {r["region"]: r for r in right.get(bucket, [])}
        for region in dict.fromkeys([*l_rows, *r_rows]):
            x, y = l_rows.get(region), r_rows.get(region)
            ratio = y["total_ms"] / x["total_ms"] if x and y and x["total_ms"] else None
            per_call = y["mean_ms"] / x["mean_ms"] if x and y and x["mean_ms"] else None
            data.setdefault(bucket, []).append({
                "region": region, "a_total_ms": x and x["total_ms"], "b_total_ms": y and y["total_ms"],
                "a_mean_ms": x and x["mean_ms"], "b_mean_ms": y and y["mean_ms"], "total_ratio": ratio,
                "mean_ratio": per_call})
            rows.append((bucket, region, "-" if x is None else f"{x['total_ms']:.2f}",
                         "-" if y is None else f"{y['total_ms']:.2f}", "-" if ratio is None else f"{ratio:.3f}",
                         "-" if per_call is None else f"{per_call:.3f}"))
    return Report("profile compare", f"{a} vs {b}",
                  columns=("bucket", "region", "A total ms", "B total ms", "B/A total", "B/A per call"),
                  rows=tuple(rows), notes=("ratios below 1: B is faster",),
                  extra={"a": str(a), "b": str(b), "buckets": data})


