"""`toolkit experiment`: each variant that lints clean is started with the exact argv and env of its run config,
measured with `toolkit bench`, archived and stopped; nothing is started beside a leftover."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from toolkit.bench.client import Conversation, Settings
from toolkit.bench.runner import bench, new_folder
from toolkit.bench.serve import ContainerServer, GpuSampler, Lifecycle, Server, leftovers
from toolkit.errors import ToolkitError
from toolkit.lint import lint
from toolkit.recipe import LoadedRecipe
from toolkit.results import Severity
from toolkit.submission.render import render
from toolkit.variants import Variant

# offline and quiet wherever the server runs: no model hub, no usage reporting
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def _set_flag(argv: list[str], flag: str, value: str) -> list[str]:
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


def server_command(run_config: str, python: Path | str, model: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """The run config's argv and env, with this machine's Python, model folder, loopback host and port."""
    config = yaml.safe_load(run_config)
    argv = [str(item) for item in config["command"]]
    if argv[:2] != ["python3", "-m"]:
        raise ToolkitError(f"the run config's command does not start with `python3 -m`: {argv[:3]}")
    argv = [str(python), *argv[1:]]
    argv = _set_flag(argv, "--model", str(model))
    argv = _set_flag(argv, "--host", "127.0.0.1")  # never listen beyond this machine
    argv = _set_flag(argv, "--port", str(port))
    env = {item["name"]: str(item["value"]) for item in config.get("env") or []}
    return argv, env


@dataclass
class VariantRun:
    variant: str
    status: str  # "measured", "DROPPED", "FAILED"
    detail: str
    ready_s: float | None = None
    stop_s: float | None = None
    runs: list[dict[str, Any]] = field(default_factory=list)


def experiment(loaded: LoadedRecipe, variants: list[Variant], conversations: list[Conversation], workload: str,
               concurrencies: list[int], settings: Settings, outdir: Path, *, python: Path | str, model: Path,
               port: int, start_timeout_s: float, sampler: GpuSampler,
               image: InImage | None = None) -> list[VariantRun]:
    """Measure every variant in turn; the server it starts is always stopped, interrupt or not. With `image`, each
    runs in that image (`/model` mapped to `model`, `python` as the run config says unless given); else here."""
    new_folder(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    results: list[VariantRun] = []
    for variant in variants:
        recipe = variant.apply(loaded.recipe)
        errors = [i for i in lint(loaded, recipe, variant=variant.name).issues if i.severity is Severity.ERROR]
        if errors:
            results.append(VariantRun(variant.name, "DROPPED", "; ".join(f"{e.rule}: {e.message}" for e in errors)))
            continue
        problems = leftovers(port, sampler)
        if problems:
            raise ToolkitError(f"refusing to start variant {variant.name}: " + "; ".join(problems),
                               hint="stop them (a leftover worker makes a configuration look impossible), then "
                               "run again")
        folder = outdir / variant.name
        run_config = render(recipe, loaded.path.name, variant.name).run_config
        url = f"http://127.0.0.1:{port}"
        server: Lifecycle
        if image is not None:
            argv, env = server_command(run_config, python, Path("/model"), port)
            server = ContainerServer(image.tag, argv, {**OFFLINE_ENV, **env}, model, folder / "server.log", url,
                                     settings.model, image.mounts, image.devices, image.gpus)
        else:
            argv, env = server_command(run_config, python, model, port)
            server = Server(argv, {**os.environ, **OFFLINE_ENV, **env}, cwd=outdir, log_path=folder / "server.log",
                            url=url, model=settings.model)
        record = VariantRun(variant.name, "FAILED", "")
        results.append(record)
        try:
            server.start()
            record.ready_s = server.wait_ready(start_timeout_s)
            sampler.start(folder / "gpu.csv")
            cores = server.client_cores()
            try:
                with _client_on(cores):
                    runs = bench(server.url, conversations, concurrencies, settings, folder / "bench",
                                 workload=workload, extra_run={"variant": variant.name, "argv": argv, "env": env,
                                                               "recipe": str(loaded.path),
                                                               "image": image.tag if image else None,
                                                               "client_cores": sorted(cores) if cores else None})
            finally:
                gpu_points = sampler.stop()
            record.runs = [dict(r.summary, run_folder=str(r.folder), gpu_samples=len(gpu_points)) for r in runs]
            record.status = "measured"
            record.detail = f"ready in {record.ready_s:.1f} s; " + ", ".join(
                f"c={r.concurrency}: success {r.summary['success_rate']:.2f}" for r in runs)
        except ToolkitError as exc:
            record.detail = exc.message.splitlines()[0]
            raise
        finally:
            record.stop_s = server.stop()
            time.sleep(0.2)
            left = leftovers(port)
            if left:
                record.detail += "; LEFT BEHIND after stop: " + "; ".join(left)
    (outdir / "experiment.json").write_text(
        yaml.safe_dump([r.__dict__ for r in results], sort_keys=False), encoding="utf-8")
    plot_experiment(outdir, results)
    return results


def plot_experiment(outdir: Path, results: list[VariantRun]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "experiment.png not drawn: matplotlib is not installed"
    measured = [(r.variant, run) for r in results for run in r.runs]
    if not measured:
        return None
    metrics = ("output_tps_agg", "ttft_p90_ms", "output_tps_e2e_p10", "cache_hit_rate")
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 4))
    labels = [f"{name}\nc={run['concurrency']}" for name, run in measured]
    for ax, metric in zip(axes, metrics, strict=True):
        ax.bar(range(len(measured)), [run.get(metric) or 0 for _, run in measured])
        ax.set_xticks(range(len(measured)), labels, fontsize=7)
        ax.set_title(metric)
    fig.tight_layout()
    fig.savefig(outdir / "experiment.png", dpi=80)
    plt.close(fig)
    return None
