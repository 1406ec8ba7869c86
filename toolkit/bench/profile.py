"""The TOOLKIT_PROFILE records of every process merged into one table per bucket (`toolkit profile`).

Each process appends cumulative summaries to profile-<pid>.jsonl (patches/src/native_fastpaths/profiling.py); its
last summary is its total. A region's row is the mean over the processes that recorded it (one per TP rank), with
each rank's total beside it, so an imbalance across ranks shows; shares are of the region's dotted parent and of
the bucket's step (the region named by the first part of the dotted names, e.g. `step`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.errors import ToolkitError

PATTERN = "profile-*.jsonl"


@dataclass
class Process:
    source: str  # the file
    pid: int | None
    rank: int | None
    summary: int
    final: bool
    sync: bool
    regions: dict[tuple[str, str], tuple[int, int, int]] = field(default_factory=dict)  # calls, total ns, max ns
    notes: list[str] = field(default_factory=list)


def _files(paths: list[Path]) -> list[Path]:
    out: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(path.glob(PATTERN)) or sorted(path.glob(f"*/{PATTERN}"))
            if not found:
                raise ToolkitError(f"{path} holds no {PATTERN}",
                                   hint="run with TOOLKIT_PROFILE=1 TOOLKIT_PROFILE_DIR=DIR and give that DIR")
            out += found
        elif path.is_file():
            out.append(path)
        else:
            raise ToolkitError(f"{path} does not exist", hint="give the TOOLKIT_PROFILE_DIR folder or its files")
    return out


def read_process(path: Path) -> Process:
    """The last whole summary in one process's file (summaries are cumulative; one cut off by a kill, fewer lines
    than its `lines` says, is skipped). Files without `lines` (written by hand) take each summary as whole."""
    whole: list[dict[str, Any]] = []
    current: list[dict[str, Any]] = []
    lines = path.read_text(encoding="utf-8").splitlines()

    def close() -> None:
        nonlocal whole
        if current and len(current) >= int(current[0].get("lines", len(current))):
            whole = current

    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                continue  # a process killed while it wrote: its last whole summary stands
            raise ToolkitError(f"{path}:{number}: not a profile record ({exc.msg})") from None
        if not isinstance(record, dict) or "summary" not in record:
            raise ToolkitError(f"{path}:{number}: not a profile record (no `summary`)",
                               hint="give files written by TOOLKIT_PROFILE=1")
        if current and record["summary"] != current[0]["summary"]:
            close()
            current = []
        current.append(record)
    close()
    if not whole:
        raise ToolkitError(f"{path}: no whole profile summary in it")
    records = whole
    head = records[0]
    process = Process(str(path), head.get("pid"), head.get("rank"), int(head["summary"]), bool(head.get("final")),
                      bool(head.get("sync")))
    for r in records:
        if "note" in r:
            process.notes.append(str(r["note"]))
        else:
            process.regions[(str(r["bucket"]), str(r["region"]))] = (int(r["calls"]), int(r["total_ns"]),
                                                                      int(r["max_ns"]))
    return process


def load(paths: list[Path]) -> list[Process]:
    return [read_process(p) for p in _files(paths)]


def _parent(region: str, present: set[str]) -> str | None:
    parts = region.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:cut])
        if candidate in present:
            return candidate
    return None


def tables(processes: list[Process]) -> dict[str, list[dict[str, Any]]]:
    """Per bucket, the regions in tree order with their merged numbers."""
    buckets: dict[str, dict[str, list[tuple[Process, tuple[int, int, int]]]]] = {}
    for p in processes:
        for (bucket, region), numbers in p.regions.items():
            buckets.setdefault(bucket, {}).setdefault(region, []).append((p, numbers))
    out: dict[str, list[dict[str, Any]]] = {}
    for bucket in sorted(buckets, key=lambda b: (b != "decode", b != "prefill", b)):
        regions = buckets[bucket]
        present = set(regions)
        rows: dict[str, dict[str, Any]] = {}
        for region, seen in regions.items():
            n = len(seen)
            rows[region] = {
                "region": region,
                "calls": sum(c for _, (c, _, _) in seen) / n,
                "total_ms": sum(t for _, (_, t, _) in seen) / n / 1e6,
                "max_ms": max(m for _, (_, _, m) in seen) / 1e6,
                "ranks": [{"rank": p.rank, "pid": p.pid, "calls": c, "total_ms": t / 1e6}
                          for p, (c, t, _) in sorted(seen, key=lambda s: (s[0].rank is None, s[0].rank or 0))],
                "parent": _parent(region, present),
            }
        for row in rows.values():
            row["mean_ms"] = row["total_ms"] / row["calls"] if row["calls"] else 0.0
            parent = rows.get(row["parent"]) if row["parent"] else None
            row["share_of_parent"] = row["total_ms"] / parent["total_ms"] if parent and parent["total_ms"] else None
            root = rows.get(row["region"].split(".")[0])
            row["share_of_step"] = row["total_ms"] / root["total_ms"] if root and root["total_ms"] else None
            totals = [r["total_ms"] for r in row["ranks"]]
            row["rank_min_ms"], row["rank_max_ms"] = min(totals), max(totals)
            row["depth"] = 0
        out[bucket] = _tree_order(rows)
    return out


def _tree_order(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Parents before their children, siblings by total, largest first; each row's depth set."""
    ordered: list[dict[str, Any]] = []

    def visit(parent: str | None, depth: int) -> None:
        children = sorted((r for r in rows.values() if r["parent"] == parent), key=lambda r: -r["total_ms"])
        for child in children:
            child["depth"] = depth
            ordered.append(child)
            visit(child["region"], depth + 1)

    visit(None, 0)
    return ordered


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def rows_of(buckets: dict[str, list[dict[str, Any]]]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for bucket, regions in buckets.items():
        for r in regions:
            name = r["region"] if r["parent"] is None else r["region"][len(r["parent"]) + 1:]
            spread = (f"{r['rank_min_ms']:.2f}..{r['rank_max_ms']:.2f}" if len(r["ranks"]) > 1 else "-")
            rows.append((bucket, "  " * r["depth"] + name, f"{r['calls']:.0f}", f"{r['total_ms']:.2f}",
                         f"{r['mean_ms']:.3f}", _pct(r["share_of_parent"]), _pct(r["share_of_step"]), spread))
    return rows


COLUMNS = ("bucket", "region", "calls", "total ms", "ms/call", "of parent", "of step", "ranks min..max ms")


def text_table(buckets: dict[str, list[dict[str, Any]]]) -> str:
    """The table as plain text (a file kept beside a run: `toolkit profile` prints the same rows)."""
    rows = [COLUMNS, *rows_of(buckets)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in
                               enumerate(zip(row, widths, strict=True))).rstrip() for row in rows) + "\n"


def plot(buckets: dict[str, list[dict[str, Any]]], path: Path) -> str:
    """One horizontal bar panel per bucket: each region's total ms, indented names as in the table."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"{path} not drawn: matplotlib is not installed (pip install 'vllm-recipe-toolkit[plot]')"
    shown = {b: rows for b, rows in buckets.items() if rows}
    if not shown:
        return f"{path} not drawn: no region recorded"
    fig, axes = plt.subplots(len(shown), 1, figsize=(10, 1.5 + 0.35 * sum(len(r) for r in shown.values())),
                             squeeze=False)
    for ax, (bucket, rows) in zip(axes[:, 0], shown.items(), strict=True):
        # tick labels are right-aligned: leading spaces would not show the nesting, a marker per level does
        names = ["· " * r["depth"] + r["region"].rsplit(".", 1)[-1] for r in rows]
        ax.barh(range(len(rows)), [r["total_ms"] for r in rows])
        ax.set_yticks(range(len(rows)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set(title=f"{bucket}: total ms per region (mean over processes)", xlabel="ms")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return f"wrote {path}"
