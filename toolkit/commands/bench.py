"""bench, bench compare and experiment: served variants measured with the evaluator's metrics."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolkit.commands.progress import PROGRESS
from toolkit.errors import EXIT_FAILED, EXIT_OK, ToolkitError
from toolkit.recipe import load_recipe
from toolkit.results import Report
from toolkit.variants import expand as expand_variants
from toolkit.variants import find as find_variant

if TYPE_CHECKING:
    from toolkit.bench.client import Conversation, Settings

WORKLOADS = ("short", "tools", "conversations", "replay")


@dataclass(frozen=True)
class Load:
    """What is sent: the workload (short, tools, conversations FILE, replay FILE) and how."""

    workload: str = "short"
    workload_file: Path | None = None  # for conversations and replay
    concurrency: tuple[int, ...] = (1,)  # closed-loop workers, one run each
    requests: int | None = None  # requests (short, tools: 8 without it) or a file's first conversations (all)
    max_tokens: int = 128
    ignore_eos: bool = False
    timeout_s: float = 600.0
    salt: bool = True  # a fresh salt per conversation per run, so an earlier run's cache cannot flatter this one

    def conversations(self) -> tuple[str, list[Conversation]]:
        from toolkit.bench import workloads

        if self.workload not in WORKLOADS:
            raise ToolkitError(f"--workload {self.workload}: expected short, tools, conversations FILE or replay FILE",
                               hint="e.g. --workload conversations tests/data/conversations.jsonl")
        if self.workload in ("short", "tools") and self.workload_file is not None:
            raise ToolkitError(f"--workload {self.workload} takes no file")
        built, left_out = workloads.build(self.workload, self.requests, self.workload_file)
        if left_out:
            print(f"bench: {left_out}", file=sys.stderr, flush=True)
        return self.workload, built

    def settings(self, url: str) -> Settings:
        from toolkit.bench.client import Settings

        return Settings(url=url, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos, timeout_s=self.timeout_s,
                        salt="" if self.salt else None)


def _report(verb: str, source: str, runs: list[tuple[str, dict[str, Any]]], notes: list[str],
            extra: dict[str, object]) -> Report:
    from toolkit.bench.output import compare_rows

    columns, rows = compare_rows(runs)
    return Report(verb, source, columns=columns, rows=tuple(rows), notes=tuple(notes), extra=extra)


@dataclass(frozen=True)
class BenchRequest:
    url: str
    output: Path  # a new folder for the run
    load: Load = field(default_factory=Load)
    monitor: str = "auto"  # auto, nvidia-smi, ixsmi (or a compatible binary), none


def _run_notes(summaries: list[dict[str, Any]]) -> list[str]:
    """Per run: bursts that make the decode rate meaningless, and what the device monitor saw."""
    notes = []
    for s in summaries:
        c = s.get("concurrency")
        if s.get("output_tps_decode_unreliable"):
            notes.append(f"c={c}: {s['stream_burst_requests']} of {s['successful']} requests got all "
                         "their tokens after the first in one burst: output_tps_decode_* is UNRELIABLE for this run "
                         "(the stream's delivery was measured, not the decoder; the official end-to-end rate stands)")
        seen = s.get("monitor") or {}
        for device, d in (seen.get("devices") or {}).items():
            power = f", power mean {d['power_w_mean']} W max {d['power_w_max']} W" if d["power_w_mean"] is not None \
                else ""
            notes.append(f"c={c}: device {device} ({seen['tool']}): utilisation mean "
                         f"{d['utilization_pct_mean']}% max {d['utilization_pct_max']}%, memory max "
                         f"{d['memory_used_mib_max']} of {d['memory_total_mib']} MiB{power}")
        notes += [f"c={c}: monitor: {n}" for n in seen.get("notes", [])]
        if seen.get("note") and seen.get("sampled"):
            notes.append(f"c={c}: monitor: {seen['note']}")
    return notes


def bench(request: BenchRequest) -> Report:
    from toolkit.bench.monitor import Monitor
    from toolkit.bench.runner import bench as run_bench

    kind, conversations = request.load.conversations()
    monitor = Monitor.resolve(request.monitor)
    PROGRESS.untouched = f"{request.output} was not written (a run is written whole at its end)"
    runs = run_bench(request.url, conversations, list(request.load.concurrency), request.load.settings(request.url),
                     request.output, workload=kind, monitor=monitor)
    notes = [f"wrote {request.output}: one folder per concurrency (run.json, requests.jsonl, summary.json, plot.png"
             + (", monitor.csv" if monitor.available else "") + ")",
             "Output TPS: output_tps_e2e_* is the official per-request rate (end-to-end, TTFT included); "
             "output_tps_decode_* is tokens after the first one over decode time (the prior art's rate)",
             "weighted_throughput_p10_output uses X = official Output TPS P10 (the public proxy); "
             "weighted_throughput_agg_output uses X = aggregate output tokens/s"]
    for run in runs:
        s = run.summary
        deltas = s.get("server_counter_deltas") or {}
        if "vllm:prefix_cache_queries_total" in deltas:
            same = (deltas["vllm:prefix_cache_queries_total"] == s["total_prompt_tokens"]
                    and deltas.get("vllm:prefix_cache_hits_total") == s["total_cached_tokens"])
            notes.append(f"c={run.concurrency}: client prompt/cached {s['total_prompt_tokens']}/"
                         f"{s['total_cached_tokens']} vs server /metrics deltas "
                         f"{deltas['vllm:prefix_cache_queries_total']:.0f}/"
                         f"{deltas.get('vllm:prefix_cache_hits_total', 0):.0f}: {'equal' if same else 'DIFFERENT'}")
        if run.plot_note:
            notes.append(run.plot_note)
    notes += _run_notes([r.summary for r in runs])
    if not monitor.available:
        notes.append(str(monitor.note))
    return _report("bench", request.url, [(f"c={r.concurrency}", r.summary) for r in runs], notes,
                   {"outdir": str(request.output), "runs": [r.summary for r in runs]})


def bench_compare(folders: list[Path]) -> Report:
    from toolkit.bench.output import load_summary

    if not folders:
        raise ToolkitError("bench compare needs run folders", hint="toolkit bench compare RUN1/c1 RUN2/c1")
    loaded_runs = [(str(f), load_summary(f)) for f in folders]
    return _report("bench compare", ", ".join(map(str, folders)), loaded_runs, [], {"runs": dict(loaded_runs)})


@dataclass(frozen=True)
class ExperimentRequest:
    recipe: Path
    output: Path
    load: Load = field(default_factory=Load)
    variants: tuple[str, ...] = ()  # by name; none: the base
    all_variants: bool = False
    python: str | None = None  # the Python whose vLLM serves, or cpu-server (default; with image: python3)
    image: str | None = None  # run each variant in this image instead
    mounts: tuple[str, ...] = ()  # with image: HOST:CONTAINER read-only binds
    devices: tuple[str, ...] = ()  # with image: device files to pass in
    gpus: bool = False  # with image: every GPU (NVIDIA container runtime)
    model: str = "tiny"  # the model folder mapped to /model, or tiny
    port: int = 0  # 0: a free one
    start_timeout_s: float = 300.0
    monitor: str = "auto"  # auto, nvidia-smi, ixsmi (or a compatible binary), none
    device_check: bool = True  # each device answers the tool and runs a tiny kernel before each start
    health_timeout_s: float = 60.0
    profile_requests: int | None = None  # --profile: a profiled run of this many requests after each timed one


def experiment(request: ExperimentRequest) -> Report:
    from toolkit.bench import cpu_server
    from toolkit.bench.experiment import InImage, Options
    from toolkit.bench.experiment import experiment as run_experiment
    from toolkit.bench.monitor import Monitor
    from toolkit.bench.serve import free_port

    loaded = load_recipe(request.recipe)
    every = expand_variants(loaded.recipe)
    if request.all_variants:
        chosen = every
    elif request.variants:
        chosen = [find_variant(loaded.recipe, name) for name in request.variants]
    else:
        chosen = every[:1]
    kind, conversations = request.load.conversations()
    image = InImage(request.image, list(request.mounts), list(request.devices), request.gpus) if request.image \
        else None
    python: Path | str
    if image is not None:
        python = request.python or "python3"  # as the run config says: the image's own Python
        if request.model == "tiny":
            raise ToolkitError("--image needs --model DIR: the model folder mapped to /model in the container")
    elif request.python in (None, "cpu-server"):
        python = cpu_server.environment()
    else:
        python = Path(request.python)
        if not python.exists():
            raise ToolkitError(f"--python {python} does not exist", hint="the Python whose vLLM serves the variants, "
                               "or `--python cpu-server` for the cached CPU test server")
    model = cpu_server.tiny_model(Path(python)) if request.model == "tiny" else Path(request.model)
    if not model.is_dir():
        raise ToolkitError(f"--model {model} is not a folder", hint="the model folder mapped to /model, or `tiny`")
    port = request.port or free_port()
    monitor = Monitor.resolve(request.monitor)
    notes: list[str] = []
    PROGRESS.untouched = f"{request.output}: the servers this run started were stopped; finished variants are kept"
    options = Options(python, model, port, request.start_timeout_s, monitor, image, request.device_check,
                      request.health_timeout_s, request.profile_requests)
    results = run_experiment(loaded, chosen, conversations, kind, list(request.load.concurrency),
                             request.load.settings(f"http://127.0.0.1:{port}"), request.output, options)
    runs = [(f"{r.variant} c={run['concurrency']}", run) for r in results for run in r.runs]
    for r in results:
        notes.append(f"{r.variant}: {r.status}: {r.detail}")
        if r.health:
            notes.append(f"{r.variant}: {r.health}")
        notes += [f"{r.variant}: measured, but not a submission: {said}" for said in r.not_a_submission]
        notes += [f"{r.variant} {n}" for n in _run_notes(r.runs)]
        if r.profile is not None:
            notes.append(f"{r.variant}: profiled run (not in the scores): "
                         + (r.profile.get("note") or f"table in {r.profile['table']}"))
    if not monitor.available:
        notes.append(str(monitor.note))
    notes.append(f"wrote {request.output}: per variant server.log and bench/ (per run monitor.csv when sampled), "
                 "experiment.json, experiment.png" + ("; per variant profile/ (profile.txt, profile.json, its own "
                                                     "bench/ and server.log)" if request.profile_requests else ""))
    report = _report("experiment", str(loaded.path), runs, notes,
                     {"outdir": str(request.output), "variants": [r.__dict__ for r in results]})
    return dataclasses.replace(report, exit_code=EXIT_OK if all(r.status != "FAILED" for r in results)
                               else EXIT_FAILED)
