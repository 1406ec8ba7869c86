"""One `toolkit bench`: the workload at each concurrency against one server, written into a new run folder."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from toolkit import __version__
from toolkit.bench import output
from toolkit.bench.client import Conversation, Settings, run
from toolkit.bench.metrics import RequestRecord, summarize
from toolkit.bench.monitor import Monitor
from toolkit.errors import ToolkitError

COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def server_counters(url: str) -> dict[str, float] | None:
    """The prefix-cache and token counters from /metrics, summed over label sets (None: no /metrics)."""
    try:
        text = httpx.get(url.rstrip("/") + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) in COUNTERS:
            found[match.group(1)] = found.get(match.group(1), 0.0) + float(match.group(3))
    return found


def server_info(url: str) -> dict[str, Any]:
    info: dict[str, Any] = {}
    with httpx.Client(timeout=10) as client:
        for route in ("/version", "/v1/models"):
            try:
                response = client.get(url.rstrip("/") + route)
                info[route] = response.json() if response.status_code == 200 else f"HTTP {response.status_code}"
            except (httpx.HTTPError, ValueError) as exc:
                info[route] = f"unavailable ({type(exc).__name__})"
    return info


@dataclass(frozen=True)
class Run:
    concurrency: int
    folder: Path
    summary: dict[str, Any]
    records: list[RequestRecord]
    plot_note: str | None


def new_folder(path: Path) -> Path:
    """A run folder must be new (or empty): a run never overwrites what is there."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ToolkitError(f"{path} exists and is not empty; nothing was touched",
                           hint="give a new folder for this run (runs are never overwritten)")
    return path


def bench(url: str, conversations: list[Conversation], concurrencies: list[int], settings: Settings,
          outdir: Path, *, workload: str, extra_run: dict[str, Any] | None = None,
          monitor: Monitor | None = None) -> list[Run]:
    """Run the workload once per concurrency (a fresh salt each), the devices sampled during each when a monitor
    is given, write everything, return the runs."""
    new_folder(outdir)
    outdir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{outdir.name}.partial.", dir=outdir.parent))
    runs: list[Run] = []
    try:
        for concurrency in concurrencies:
            salted = replace(settings, salt=uuid.uuid4().hex[:12]) if settings.salt is not None else settings
            before = server_counters(url)
            total = sum(1 if c.body is not None else len(c.turns) for c in conversations)
            with Progress(TextColumn(f"[bold]bench c={concurrency}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), transient=True, console=None) as progress:
                task = progress.add_task("requests", total=total)
                started = time.time()

                def advance(_record: RequestRecord, task: TaskID = task) -> None:
                    progress.advance(task)

                if monitor is not None:
                    monitor.start()
                try:
                    records, wall = asyncio.run(run(conversations, salted, concurrency, on_done=advance))
                finally:
                    samples = monitor.stop() if monitor is not None else []
            after = server_counters(url)
            summary = summarize(records, wall)
            if monitor is not None:
                summary["monitor"] = monitor.summary()
            summary.update(concurrency=concurrency, workload=workload, salt=salted.salt,
                           max_tokens=settings.max_tokens, ignore_eos=settings.ignore_eos)
            if before is not None and after is not None:
                summary["server_counter_deltas"] = {k: after[k] - before.get(k, 0.0) for k in after}
            folder = staging / f"c{concurrency}"
            run_info = {"url": url, "client": f"toolkit {__version__}", "python": sys.version.split()[0],
                        "started_unix": started, "workload": workload, "concurrency": concurrency,
                        "settings": {"model": settings.model, "max_tokens": settings.max_tokens,
                                     "ignore_eos": settings.ignore_eos, "timeout_s": settings.timeout_s,
                                     "salt": salted.salt},
                        "server": server_info(url), **(extra_run or {})}
            output.write_run(folder, run_info, records, summary)
            if monitor is not None:
                monitor.write_samples(folder)
            note = output.plot(folder, records, summary, samples)
            runs.append(Run(concurrency, outdir / folder.name, summary, records, note))
        if outdir.exists():
            outdir.rmdir()  # new_folder() proved it empty
        os.replace(staging, outdir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return runs
