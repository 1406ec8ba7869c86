"""Cached virtual environments built by pip (the CPU test server, the CPU runtime of vendor trees)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from toolkit.errors import InputError
from toolkit.inputs import COMPLETE, cache_dir, cached_tree

TORCH = "torch==2.13.0"  # the CPU wheel this machine's pip finds; a plain `torch` pulls a CUDA build


def pip(python: Path, *args: str) -> None:
    proc = subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise InputError(f"pip {' '.join(args[:3])} ... failed:\n{tail}",
                          hint="check that the package index is reachable, then run again (nothing half-built "
                          "is kept)")


def python_tag() -> str:
    return f"py{sys.version_info[0]}.{sys.version_info[1]}"


def venv(kind: str, name: str, fill: Callable[[Path, Path, Callable[[str], None]], None], about: str) -> Path:
    """The Python of a cached environment `kind/name` (name says the Python too, see python_tag), made once: a venv
    that `fill(python, scratch, say)` installs into, saying what it installs while it does (about: how long and how
    big, for the first message)."""
    target = cache_dir() / kind / name

    def say(text: str) -> None:
        print(f"[{kind}] {text}", file=sys.stderr, flush=True)

    def build(tree: Path, scratch: Path) -> None:
        say(f"building the environment once in {target} ({about})")
        subprocess.run([sys.executable, "-m", "venv", str(tree)], check=True)
        fill(tree / "bin" / "python", scratch, say)

    return cached_tree(target, build) / "bin" / "python"


def cached_python(kind: str, name: str) -> Path | None:
    """The environment's Python when it is already built (None: building it is the caller's decision)."""
    target = cache_dir() / kind / name
    return target / "bin" / "python" if (target / COMPLETE).exists() else None


def importable(python: Path, modules: list[str]) -> dict[str, bool]:
    """Whether each top-level module can be found by that Python (with importlib.util.find_spec: nothing runs)."""
    if not modules:
        return {}
    code = ("import importlib.util, json, sys; "
            "print(json.dumps({m: importlib.util.find_spec(m) is not None for m in sys.argv[1:]}))")
    proc = subprocess.run([str(python), "-c", code, *modules], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin"})
    found = json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else {}
    return {m: bool(found.get(m)) for m in modules}
