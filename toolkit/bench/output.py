"""What a run leaves behind: run.json, requests.jsonl, summary.json, the targets' verdicts, an optional plot,
and the side-by-side comparison of several runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from toolkit.bench.metrics import TARGETS, RequestRecord
from toolkit.errors import ToolkitError

SUMMARY = "summary.json"
REQUESTS = "requests.jsonl"
RUN = "run.json"
PLOT = "plot.png"


def verdicts(summary: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for target in TARGETS:
        met, got = target.check(summary)
        out.append({"metric": target.metric, "op": target.op, "target": target.value, "value": got,
                    "met": met, "why": target.why})
    return out


def write_run(folder: Path, run: dict[str, Any], records: list[RequestRecord], summary: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RUN).write_text(json.dumps(run, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    with (folder / REQUESTS).open("w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record.as_json(), sort_keys=True) + "\n")
    data = dict(summary, targets=verdicts(summary))
    (folder / SUMMARY).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def plot(folder: Path, records: list[RequestRecord], summary: dict[str, Any],
         gpu: list[tuple[float, float]] | None = None) -> str | None:
    """plot.png (TTFT CDF, Output TPS histogram with its P10, tokens/s and requests in flight, GPU use); the
    reason when it cannot be drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot.png not drawn: matplotlib is not installed (pip install 'vllm-recipe-toolkit[plot]')"
    ok = [r for r in records if r.ok]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ttfts = sorted((r.ttft or 0) * 1000 for r in ok)
    axes[0][0].plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))] if ttfts else [])
    axes[0][0].set(title="TTFT CDF", xlabel="ms", ylabel="fraction of requests")
    tps = [v for r in ok if (v := r.output_tps_e2e) is not None]
    axes[0][1].hist(tps, bins=20)
    if summary.get("output_tps_e2e_p10") is not None:
        axes[0][1].axvline(summary["output_tps_e2e_p10"], color="red", label="P10")
        axes[0][1].legend()
    axes[0][1].set(title="Output TPS per request (official: end-to-end)", xlabel="tokens/s")
    end = max(((r.t0 + (r.e2e or 0)) for r in records), default=0.0)
    steps = [end * i / 100 for i in range(101)]
    axes[1][0].plot(steps, [sum(1 for r in records if r.t0 <= t <= r.t0 + (r.e2e or 0)) for t in steps])
    axes[1][0].set(title="requests in flight", xlabel="s since start")
    seconds = int(end) + 1
    per_second = [0.0] * seconds
    for r in ok:
        if r.content_times:
            share = r.completion_tokens / len(r.content_times)
            for t in r.content_times:
                per_second[min(int(r.t0 + t), seconds - 1)] += share
    axes[1][1].plot(range(seconds), per_second, label="output tokens/s")
    if gpu:
        twin = axes[1][1].twinx()
        twin.plot([t for t, _ in gpu], [u for _, u in gpu], color="green", label="GPU %")
        twin.set_ylabel("GPU utilisation %")
    axes[1][1].set(title="tokens/s over time", xlabel="s since start")
    fig.tight_layout()
    fig.savefig(folder / PLOT, dpi=80)
    plt.close(fig)
    return None


def load_summary(folder: Path) -> dict[str, Any]:
    path = folder / SUMMARY
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ToolkitError(f"{folder} holds no {SUMMARY}", hint="give run folders written by `toolkit bench`") from None
    except json.JSONDecodeError as exc:
        raise ToolkitError(f"{path}:{exc.lineno}: not JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise ToolkitError(f"{path}: not a summary object")
    return data


COMPARE = ("success_rate", "cache_hit_rate", "ttft_p50_ms", "ttft_p90_ms", "output_tps_e2e_p10",
           "output_tps_decode_p10", "output_tps_agg", "uncached_input_tps_agg", "cache_tps_agg",
           "official_replay_score", "weighted_throughput_agg_output", "weighted_throughput_p10_output")


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def compare_rows(runs: list[tuple[str, dict[str, Any]]]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """One row per metric, one column per run, and the target beside it."""
    targets = {t.metric: t for t in TARGETS}
    columns = ("metric", *(name for name, _ in runs), "target")
    rows = []
    for metric in COMPARE:
        cells = []
        target = targets.get(metric)
        for _, summary in runs:
            verdict = target.check(summary)[0] if target else None
            cells.append(fmt(summary.get(metric)) + ("" if verdict is None else " ok" if verdict else " MISSED"))
        rows.append((metric, *cells, f"{target.op} {target.value:g}" if target else ""))
    return columns, rows
