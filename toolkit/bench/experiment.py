"""`toolkit experiment`: each variant that lints clean is started with the exact argv and env of its run config,
measured with `toolkit bench`, archived and stopped; nothing is started beside a leftover."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from toolkit.bench.client import Conversation, Settings
from toolkit.bench.monitor import Monitor, health, local_check
from toolkit.bench.runner import bench, new_folder
from toolkit.bench.serve import ContainerServer, Lifecycle, Server, leftovers
from toolkit.errors import ToolkitError
from toolkit.lint import lint
from toolkit.recipe import LoadedRecipe
from toolkit.submission.render import render
from toolkit.variants import Variant

# offline and quiet wherever the server runs: no model hub, no usage reporting
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value given to `flag` in argv (None: not given, or given as a switch with no value)."""
    if flag in argv:
        index = argv.index(flag)
        if index + 1 < len(argv) and not argv[index + 1].startswith("--"):
            return argv[index + 1]
    return None


def set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    if flag in out:
        index = out.index(flag)
        if index + 1 < len(out):
            out[index + 1] = value
            return out
    return [*out, flag, value]


@contextlib.contextmanager
def _client_on(cores: set[int] | None) -> Iterator[None]:
    """This process (the bench client) on the cores the server left free, for the run only."""
    if not cores:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@dataclass(frozen=True)
class InImage:
    """Run each variant in this image with `docker run` instead of with a Python here."""

    tag: str
    mounts: list[str] = field(default_factory=list)  # extra read-only HOST:CONTAINER mounts
    devices: list[str] = field(default_factory=list)  # device files to pass in (e.g. /dev/iluvatar0)
    gpus: bool = False  # request every GPU (the NVIDIA container runtime)
    writable: list[str] = field(default_factory=list)  # HOST:CONTAINER mounts the server writes into


def server_command(run_config: str, python: Path | str, model: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """The run config's argv and env, with this machine's Python, model folder, loopback host and port."""
    config = yaml.safe_load(run_config)
    argv = [str(item) for item in config["command"]]
    if argv[:2] != ["python3", "-m"]:
        raise ToolkitError(f"the run config's command does not start with `python3 -m`: {argv[:3]}")
    argv = [str(python), *argv[1:]]
    argv = set_flag(argv, "--model", str(model))
    argv = set_flag(argv, "--host", "127.0.0.1")  # never listen beyond this machine
    argv = set_flag(argv, "--port", str(port))
    return argv, run_config_env(run_config)


def run_config_env(run_config: str) -> dict[str, str]:
    """The run config's env, as the platform sets it."""
    return {item["name"]: str(item["value"]) for item in yaml.safe_load(run_config).get("env") or []}


@dataclass
class VariantRun:
    variant: str
    status: str  # "measured", "DROPPED", "FAILED"
    detail: str
    ready_s: float | None = None
    stop_s: float | None = None
    runs: list[dict[str, Any]] = field(default_factory=list)
    health: str | None = None  # what the device check before the start found
    not_a_submission: list[str] = field(default_factory=list)  # what only the platform's submission requires
    profile: dict[str, Any] | None = None  # the profiled run (--profile): never part of runs or scores


@dataclass(frozen=True)
class Options:
    """How each variant is run besides its recipe."""

    python: Path | str
    model: Path
    port: int
    start_timeout_s: float
    monitor: Monitor
    image: InImage | None = None
    device_check: bool = True
    health_timeout_s: float = 60.0
    profile_requests: int | None = None  # --profile: a profiled run of this many requests after the timed one


PROFILE_ENV = {"TOOLKIT_PROFILE": "1", "TOOLKIT_PROFILE_SYNC": "1", "TOOLKIT_PROFILE_EVERY": "8"}


def _server(loaded: LoadedRecipe, recipe: Any, variant: str, folder: Path, outdir: Path, settings: Settings,
            options: Options, extra_env: dict[str, str], log_name: str) -> tuple[Lifecycle, list[str], dict[str, str]]:
    run_config = render(recipe, loaded.path.name, variant).run_config
    url = f"http://127.0.0.1:{options.port}"
    image = options.image
    if image is not None:
        argv, env = server_command(run_config, options.python, Path("/model"), options.port)
        env = {**env, **extra_env}
        return (ContainerServer(image.tag, argv, {**OFFLINE_ENV, **env}, options.model, folder / log_name, url,
                                settings.model, image.mounts, image.devices, image.gpus, image.writable), argv, env)
    argv, env = server_command(run_config, options.python, options.model, options.port)
    env = {**env, **extra_env}
    return (Server(argv, {**os.environ, **OFFLINE_ENV, **env}, cwd=outdir, log_path=folder / log_name, url=url,
                   model=settings.model), argv, env)


def _refuse_leftovers(variant: str, options: Options) -> None:
    problems = leftovers(options.port, options.monitor)
    if problems:
        raise ToolkitError(f"refusing to start variant {variant}: " + "; ".join(problems),
                           hint="stop them (a leftover worker makes a configuration look impossible), then run again")


def _check_devices(variant: str, options: Options, server: Lifecycle) -> str:
    """The device health check before a start, by the Python that will serve (here, or in the image): a sick
    device refuses the start, named."""
    if not options.device_check:
        return "device health not checked: --no-device-check"
    check = server.kernel_check if isinstance(server, ContainerServer) else local_check([str(options.python)])
    ok, found = health(options.monitor, check, options.health_timeout_s)
    if not ok:
        raise ToolkitError(f"refusing to start variant {variant}: {found}",
                           hint="take the card out of the visible devices (CUDA_VISIBLE_DEVICES, or the platform's "
                           "device list) or reset it; --no-device-check skips this check")
    return found


def experiment(loaded: LoadedRecipe, variants: list[Variant], conversations: list[Conversation], workload: str,
               concurrencies: list[int], settings: Settings, outdir: Path, options: Options) -> list[VariantRun]:
    """Measure every variant in turn; the server it starts is always stopped, interrupt or not. With an image,
    each runs in it (`/model` mapped to the model, the Python as the run config says unless given); else here."""
    new_folder(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    results: list[VariantRun] = []
    for variant in variants:
        recipe = variant.apply(loaded.recipe)
        linted = lint(loaded, recipe, variant=variant.name, for_submission=False)
        errors = linted.refusals
        if errors:
            results.append(VariantRun(variant.name, "DROPPED", "; ".join(f"{e.rule}: {e.message}" for e in errors)))
            continue
        _refuse_leftovers(variant.name, options)
        folder = outdir / variant.name
        server, argv, env = _server(loaded, recipe, variant.name, folder, outdir, settings, options, {}, "server.log")
        record = VariantRun(variant.name, "FAILED", "", health=_check_devices(variant.name, options, server),
                            not_a_submission=[f"{i.rule}: {i.message}" for i in linted.not_a_submission])
        results.append(record)
        try:
            server.start()
            record.ready_s = server.wait_ready(options.start_timeout_s)
            cores = server.client_cores()
            with _client_on(cores):
                runs = bench(server.url, conversations, concurrencies, settings, folder / "bench",
                             workload=workload, monitor=options.monitor,
                             extra_run={"variant": variant.name, "argv": argv, "env": env,
                                        "recipe": str(loaded.path),
                                        "image": options.image.tag if options.image else None,
                                        "client_cores": sorted(cores) if cores else None,
                                        "device_health": record.health})
            record.runs = [dict(r.summary, run_folder=str(r.folder)) for r in runs]
            record.status = "measured"
            record.detail = f"ready in {record.ready_s:.1f} s; " + ", ".join(
                f"c={r.concurrency}: success {r.summary['success_rate']:.2f}" for r in runs)
        except ToolkitError as exc:
            record.detail = exc.message.splitlines()[0]
            raise
        finally:
            record.stop_s = server.stop()
            time.sleep(0.2)
            left = leftovers(options.port)
            if left:
                record.detail += "; LEFT BEHIND after stop: " + "; ".join(left)
        if options.profile_requests and record.status == "measured":
            record.profile = _profiled_run(loaded, recipe, variant.name, folder, outdir, conversations, workload,
                                           concurrencies[0], settings, options)
    (outdir / "experiment.json").write_text(
        yaml.safe_dump([r.__dict__ for r in results], sort_keys=False), encoding="utf-8")
    plot_experiment(outdir, results)
    return results


def _profiled_run(loaded: LoadedRecipe, recipe: Any, variant: str, folder: Path, outdir: Path,
                  conversations: list[Conversation], workload: str, concurrency: int, settings: Settings,
                  options: Options) -> dict[str, Any]:
    """The same workload, shorter, on a fresh server with the probes on (and the device synchronised around each
    region): its `toolkit profile` table lands in the variant's profile/ folder, its numbers never in the scores."""
    from toolkit.bench.profile import load, tables, text_table

    where = folder / "profile"
    raw = where / "records"
    raw.mkdir(parents=True)
    _refuse_leftovers(variant, options)
    extra = {**PROFILE_ENV, "TOOLKIT_PROFILE_DIR": "/toolkit-profile" if options.image else str(raw)}
    image = options.image
    if image is not None:  # the records are written inside the container: bind the folder there
        options = dataclasses.replace(options, image=dataclasses.replace(image, writable=[f"{raw}:/toolkit-profile"]))
    server, _, _ = _server(loaded, recipe, variant, where, outdir, settings, options, extra, "server.log")
    out: dict[str, Any] = {"folder": str(where), "env": extra, "requests": options.profile_requests}
    try:
        server.start()
        server.wait_ready(options.start_timeout_s)
        bench(server.url, conversations[:options.profile_requests], [concurrency], settings, where / "bench",
              workload=workload)
    except ToolkitError as exc:
        out["note"] = f"the profiled run failed: {exc.message.splitlines()[0]}"
        return out
    finally:
        server.stop()
    files = sorted(raw.glob("profile-*.jsonl"))
    if not files:
        out["note"] = ("the profiled run wrote no record: the server's code carries no probe (a server from a "
                       "tree the recipe's probe transforms were applied to writes them)")
        return out
    buckets = tables(load([raw]))
    (where / "profile.json").write_text(json.dumps({"buckets": buckets}, indent=2) + "\n", encoding="utf-8")
    (where / "profile.txt").write_text(text_table(buckets), encoding="utf-8")
    out["buckets"] = {b: len(rows) for b, rows in buckets.items()}
    out["table"] = str(where / "profile.txt")
    return out


RATES = ("cache_hit_rate", "success_rate")


def plot_experiment(outdir: Path, results: list[VariantRun]) -> str | None:
    """experiment.png: one bar panel per metric, a bar per variant and concurrency, its value written on it; rates
    on a 0..1 axis, the official target drawn where the metric has one, a panel with no value says so."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "experiment.png not drawn: matplotlib is not installed"
    from toolkit.bench.metrics import TARGETS

    measured = [(r.variant, run) for r in results for run in r.runs]
    if not measured:
        return None
    targets = {t.metric: t for t in TARGETS}
    metrics = ["output_tps_agg", "ttft_p90_ms", "output_tps_e2e_p10", "cache_hit_rate", "success_rate"]
    if any((run.get("monitor") or {}).get("devices") for _, run in measured):
        metrics.append("device_utilization_pct_mean")
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.6 * len(metrics), 4.2))
    labels = [f"{name}\nc={run['concurrency']}" for name, run in measured]
    for ax, metric in zip(axes, metrics, strict=True):
        values = [_metric(run, metric) for _, run in measured]
        ax.set_title(metric, fontsize=9)
        if all(v is None for v in values):
            ax.text(0.5, 0.5, f"no run reported {metric}", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        bars = ax.bar(range(len(measured)), [v or 0 for v in values])
        for bar, value in zip(bars, values, strict=True):
            ax.annotate("-" if value is None else f"{value:.3g}", (bar.get_x() + bar.get_width() / 2,
                        bar.get_height()), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(measured)), labels, fontsize=7)
        if metric in RATES or metric == "device_utilization_pct_mean":
            ax.set_ylim(0, 1.05 if metric in RATES else 100)
        else:
            ax.set_ylim(0, max(v or 0 for v in values) * 1.2 or 1)
        target = targets.get(metric)
        if target is not None:
            ax.axhline(target.value, color="red", linestyle="--", label=f"target {target.op} {target.value:g}")
            top = ax.get_ylim()[1]
            if target.value > top:
                ax.set_ylim(0, target.value * 1.1)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(outdir / "experiment.png", dpi=80)
    plt.close(fig)
    return None


def _metric(run: dict[str, Any], metric: str) -> float | None:
    if metric == "device_utilization_pct_mean":
        devices = (run.get("monitor") or {}).get("devices") or {}
        values = [d["utilization_pct_mean"] for d in devices.values() if d.get("utilization_pct_mean") is not None]
        return sum(values) / len(values) if values else None
    value = run.get(metric)
    return float(value) if isinstance(value, int | float) else None
