"""Cached virtual environments built by pip (the CPU test server, the CPU runtime of vendor trees)."""

from __future__ import annotations

import hashlib
import inspect
import json
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from toolkit.errors import InputError
from toolkit.inputs import COMPLETE, cache_dir, cached_tree

TORCH = "torch==2.13.0"  # the CPU wheel this machine's pip finds; a plain `torch` pulls a CUDA build

# Python puts a script's own folder (or, for -c, the working directory) first on sys.path, so a sibling named like
# a standard-library module (toolkit/bench/profile.py, imported by cProfile while torch loads) shadows it. Every
# script the toolkit runs in another Python starts through this bootstrap instead: run with -c, the only entry
# Python adds is the working directory, which is dropped before anything else is imported (runpy, and what it
# imports, included); runpy.run_path then runs the script without adding its folder. Not -I (it ignores
# PYTHONPATH, which the runtime's stand-ins and trees need) and not -P (Python 3.11+; the runtime may be 3.10).
ISOLATE = ("import sys\n"  # sys is built in: nothing on the path can shadow it
           "if not getattr(sys.flags, 'safe_path', False):\n"
           "    del sys.path[0]\n")
_RUN_SCRIPT = ISOLATE + "import runpy\nsys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"


def script(python: Path | str, path: Path, *args: str) -> list[str]:
    """The argv that runs `python path args...` with nothing beside `path` shadowing a module it imports."""
    return [str(python), "-c", _RUN_SCRIPT, str(path), *args]


def code(python: Path | str, source: str, *args: str) -> list[str]:
    """The argv that runs `python -c source args...` with nothing in the working directory shadowing a module."""
    return [str(python), "-c", ISOLATE + source, *args]


def build_key(*parts: object, builders: Sequence[Callable[..., object]] = (), files: Sequence[Path] = ()) -> str:
    """What decides a cached artefact's content, hashed: the pins and settings (parts), the builder functions'
    own source, the builder files' bytes, and the interpreter that builds it; any change builds it again."""
    digest = hashlib.sha256()
    digest.update(json.dumps([list(map(str, parts)), sys.version, platform.machine(),
                              sys.implementation.cache_tag]).encode())
    for builder in builders:
        digest.update(inspect.getsource(builder).encode())
    for file in files:  # by name and content: a rename or a new empty file changes the key too
        data = file.read_bytes()
        digest.update(f"{'/'.join(file.parts[-2:])}\0{len(data)}\0".encode() + hashlib.sha256(data).digest())
    return digest.hexdigest()[:12]


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


Fill = Callable[[Path, Path, Callable[[str], None]], None]


def _target(kind: str, name: str, fill: Fill, pins: Sequence[str]) -> Path:
    return cache_dir() / kind / f"{name}-{python_tag()}-{build_key(*pins, builders=[fill])}"


def venv(kind: str, name: str, fill: Fill, about: str, pins: Sequence[str]) -> Path:
    """The Python of a cached environment `kind/name-<python>-<key>`, made once: a venv that
    `fill(python, scratch, say)` installs into, saying what it installs while it does (about: how long and how big,
    for the first message). The key is the pins, fill's own source and the interpreter (build_key): a change to
    any of them builds a new environment."""
    target = _target(kind, name, fill, pins)

    def say(text: str) -> None:
        print(f"[{kind}] {text}", file=sys.stderr, flush=True)

    def build(tree: Path, scratch: Path) -> None:
        say(f"building the environment once in {target} ({about})")
        subprocess.run([sys.executable, "-m", "venv", str(tree)], check=True)
        fill(tree / "bin" / "python", scratch, say)

    return cached_tree(target, build) / "bin" / "python"


def cached_python(kind: str, name: str, fill: Fill, pins: Sequence[str]) -> Path | None:
    """The environment's Python when it is already built (None: building it is the caller's decision)."""
    target = _target(kind, name, fill, pins)
    return target / "bin" / "python" if (target / COMPLETE).exists() else None


def importable(python: Path, modules: list[str]) -> dict[str, bool]:
    """Whether each top-level module can be found by that Python (with importlib.util.find_spec: nothing runs)."""
    if not modules:
        return {}
    find = ("import importlib.util, json, sys\n"
            "print(json.dumps({m: importlib.util.find_spec(m) is not None for m in sys.argv[1:]}))\n")
    proc = subprocess.run(code(python, find, *modules), capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin"})
    found = json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else {}
    return {m: bool(found.get(m)) for m in modules}
