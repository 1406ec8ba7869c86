"""What a run leaves behind: run.json, requests.jsonl, summary.json, the targets' verdicts, an optional plot,
and the side-by-side comparison of several runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from toolkit.bench.metrics import TARGETS, RequestRecord
from toolkit.bench.monitor import Sample
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


def _empty(ax: Any, why: str) -> None:
    """A panel with nothing to draw says why, instead of showing empty axes."""
    ax.text(0.5, 0.5, why, ha="center", va="center", wrap=True, fontsize=9, transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def bin_width(span_s: float) -> float:
    """About 40 bins over the run, at least 10 ms: a 2 s run is not one 1-second bin."""
    return max(span_s / 40, 0.01)


def plot(folder: Path, records: list[RequestRecord], summary: dict[str, Any],
         samples: list[Sample] | None = None) -> str | None:
    """plot.png: TTFT CDF and Output TPS (with their official targets), tokens/s and requests in flight over the
    run, each stream's delivery (bursts marked) and the devices' utilisation and power under requests in flight on
    the same time axis; a panel without data says why. The reason when it cannot be drawn at all."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot.png not drawn: matplotlib is not installed (pip install 'vllm-recipe-toolkit[plot]')"
    targets = {t.metric: t for t in TARGETS}
    ok = [r for r in records if r.ok]
    fig, axes = plt.subplots(3, 2, figsize=(13, 11))
    ax = axes[0][0]
    ttfts = sorted((r.ttft or 0) * 1000 for r in ok)
    if ttfts:
        ax.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], marker=".")
        goal = targets["ttft_p90_ms"].value
        if goal <= max(ttfts) * 1.5:
            ax.axvline(goal, color="red", linestyle="--", label=f"target: P90 <= {goal:.0f} ms")
        else:  # drawn to scale it would flatten the curve: named, off the axis
            ax.plot([], [], color="red", linestyle="--", label=f"target: P90 <= {goal:.0f} ms (right of the axis)")
        ax.axhline(0.9, color="grey", linestyle=":", label="P90")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=8)
        ax.set(title="TTFT CDF", xlabel="ms", ylabel="fraction of requests")
    else:
        _empty(ax, "TTFT CDF: no successful request")
        ax.set_title("TTFT CDF")
    ax = axes[0][1]
    tps = [v for r in ok if (v := r.output_tps_e2e) is not None]
    if tps:
        ax.hist(tps, bins=min(20, max(1, len(tps))))
        if summary.get("output_tps_e2e_p10") is not None:
            ax.axvline(summary["output_tps_e2e_p10"], color="blue", label="P10")
        goal = targets["output_tps_e2e_p10"].value
        ax.axvline(goal, color="red", linestyle="--", label=f"target: P10 >= {goal:g}")
        ax.legend(fontsize=8)
        ax.set(title="Output TPS per request (official: end-to-end)", xlabel="tokens/s", ylabel="requests")
    else:
        _empty(ax, "Output TPS: no successful request with tokens")
        ax.set_title("Output TPS per request")
    end = max(((r.t0 + (r.e2e or 0)) for r in records), default=0.0)
    ax = axes[1][0]
    width = bin_width(end)
    bins = int(end / width) + 1
    per_bin = [0.0] * bins
    for r in ok:
        if r.content_times:
            share = r.completion_tokens / len(r.content_times)
            for t in r.content_times:
                per_bin[min(int((r.t0 + t) / width), bins - 1)] += share
    if any(per_bin):
        ax.step([i * width for i in range(bins)], [v / width for v in per_bin], where="post")
        ax.set(title=f"output tokens/s over time ({width * 1000:.0f} ms bins)", xlabel="s since start",
               ylabel="tokens/s")
    else:
        _empty(ax, "tokens/s over time: no token arrived")
        ax.set_title("output tokens/s over time")
    ax = axes[1][1]
    steps = [end * i / 200 for i in range(201)]
    ax.plot(steps, [sum(1 for r in records if r.t0 <= t <= r.t0 + (r.e2e or 0)) for t in steps])
    ax.set(title="requests in flight", xlabel="s since start", ylabel="requests")
    ax = axes[2][0]
    if ok:
        for i, r in enumerate(sorted(ok, key=lambda r: r.t0)):
            color = "red" if r.burst else "tab:blue"
            ax.plot([r.t0, r.t0 + (r.ttft or 0)], [i, i], color="lightgrey", linewidth=3)
            ax.plot([r.t0 + (r.ttft or 0), r.t0 + (r.e2e or 0)], [i, i], color=color, linewidth=3)
            if r.burst:  # a burst is too short to see as a line
                ax.plot([r.t0 + (r.e2e or 0)], [i], "o", color="red")
        bursts = summary.get("stream_burst_requests", 0)
        ax.set(title=f"each stream: waiting (grey), tokens arriving (blue; red: all in one burst, {bursts} of "
               f"{len(ok)})", xlabel="s since start", ylabel="request")
        ax.title.set_fontsize(9)
    else:
        _empty(ax, "stream delivery: no successful request")
    ax = axes[2][1]
    monitor = summary.get("monitor") or {}
    if samples:
        ax.sharex(axes[1][1])  # under requests in flight, on its time axis
        devices = sorted({s.device for s in samples})
        for device in devices:
            mine = [s for s in samples if s.device == device and s.utilization_pct is not None]
            ax.plot([s.t_s for s in mine], [s.utilization_pct for s in mine], marker="o",
                    label=f"device {device} util %")  # markers: a run of a second or two has one sample or two
        ax.set_ylim(0, 100)
        ax.set(ylabel="utilisation %")
        power = [s for s in samples if s.power_w is not None]
        if power:
            twin = ax.twinx()
            for device in devices:
                mine = [s for s in power if s.device == device]
                twin.plot([s.t_s for s in mine], [s.power_w for s in mine], linestyle=":", marker="x",
                          label=f"{device} W")
            twin.set_ylabel("power W")
        ax.legend(fontsize=7, loc="upper left")
        count = len({s.t_s for s in samples})
        ax.set(title=f"devices ({monitor.get('tool', '?')}, {count} sample(s), one a second)",
               xlabel="s since start")
    else:
        why = monitor.get("note") or (monitor.get("notes") or [None])[0] or "devices not sampled (no monitor)"
        _empty(ax, str(why))
        ax.set_title("devices")
    if summary.get("output_tps_decode_unreliable"):
        fig.suptitle(f"{summary.get('stream_burst_requests')} of {len(ok)} streams arrived in one burst after the "
                     "first token: output_tps_decode_* is unreliable here", color="red")
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
           "output_tps_decode_p10", "stream_burst_requests", "output_tps_agg", "uncached_input_tps_agg",
           "cache_tps_agg", "official_replay_score", "weighted_throughput_agg_output", "weighted_throughput_p10_output")


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
            mark = " UNRELIABLE (bursts)" if metric.startswith("output_tps_decode") and summary.get(
                "output_tps_decode_unreliable") else ""
            cells.append(fmt(summary.get(metric)) + ("" if verdict is None else " ok" if verdict else " MISSED")
                         + mark)
        rows.append((metric, *cells, f"{target.op} {target.value:g}" if target else ""))
    return columns, rows
