"""Import-safe stand-ins for the vendor image's GPU-only libraries (`base_image.gpu_libraries`: ixformer, xformers),
so that a vendor tree that imports them at module level can be imported and configured on a CPU.

Standard library only: the CPU runtime's Python loads this file through the `sitecustomize` that `site_dir()`
writes (activated by TOOLKIT_GPU_STANDINS, a comma-separated list of top-level names), from outside the tree, as
the preflight's stand-in pynvml is. A stand-in library is added at the end of the import path, so a library that
is really installed wins. Under it every submodule imports and every attribute resolves (to a class, so the tree
can subclass it, annotate with it and decorate with it at import time); a call from inside a function, the point
where the image would run GPU code, raises `StandInCalled` naming the library, the attribute and the caller's
file:line, except the few calls in MAPPED, which run their PyTorch equivalent (and are recorded as such).
"""

from __future__ import annotations

import atexit
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ENV = "TOOLKIT_GPU_STANDINS"  # the libraries to stand in, comma-separated
RECORD_ENV = "TOOLKIT_GPU_STANDINS_RECORD"  # a file the record is written to at exit (JSON)
# calls the vendor tree makes on the paths preflight and the runtime tests run, and what does the same on a CPU:
# the CoreX linear.py's forward calls ixformer.functions.linear where upstream calls torch.nn.functional.linear
MAPPED: dict[str, str] = {
    "ixformer.functions.linear": "torch.nn.functional:linear",
}


class StandInCalled(RuntimeError):
    """The tree called a GPU library that only the image has."""


RECORD: dict[str, Any] = {"libraries": [], "modules": [], "calls": []}
_CLASSES: dict[str, type] = {}


def _where(frame: types.FrameType | None) -> str:
    if frame is None:
        return "<unknown>"
    name = frame.f_code.co_filename
    for marker in ("/vllm/", "/transformers/", "/native_fastpaths/"):
        if marker in name:
            name = marker[1:] + name.rsplit(marker, 1)[1]
            break
    return f"{name}:{frame.f_lineno}"


def _at_definition_time(frame: types.FrameType | None) -> bool:
    """A module or class body: where a decorator or a base class is evaluated, not where GPU code runs."""
    if frame is None:
        return False
    return frame.f_code.co_name == "<module>" or ("__module__" in frame.f_locals and "__qualname__" in frame.f_locals)


def _target(spec: str) -> Callable[..., Any]:
    module, _, attr = spec.partition(":")
    func: Callable[..., Any] = getattr(importlib.import_module(module), attr)
    return func


class _StandInMeta(type):
    """The class of every stand-in attribute: attribute access gives more stand-ins, a call raises (or maps)."""

    _standin_name: str

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return standin(f"{cls._standin_name}.{name}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if "_standin_name" not in cls.__dict__:  # a class the tree derived from a stand-in: its own
            return super().__call__(*args, **kwargs)
        name = cls._standin_name
        caller = sys._getframe(1)
        where = _where(caller)
        if name in MAPPED:
            RECORD["calls"].append({"name": name, "where": where, "mapped": MAPPED[name]})
            return _target(MAPPED[name])(*args, **kwargs)
        if _at_definition_time(caller):
            # a decorator (or its factory) applied while a module or class is defined: stand in for the result
            return standin(f"{name}(...)")
        RECORD["calls"].append({"name": name, "where": where, "mapped": None})
        library = next((n for n in RECORD["libraries"] if name == n or name.startswith(n + ".")), name.split(".")[0])
        raise StandInCalled(f"{name} called from {where}: {library} is a GPU library of the image, stood in on this "
                            f"CPU (base_image.gpu_libraries); this code path runs only on the image")

    def __repr__(cls) -> str:
        return f"<GPU library stand-in {cls._standin_name}>"


def standin(name: str) -> type:
    """The stand-in class for a dotted name (one per name, so identity and isinstance hold)."""
    if name not in _CLASSES:
        short = name.rsplit(".", 1)[-1].replace("(...)", "") or "standin"
        _CLASSES[name] = _StandInMeta(short, (), {"_standin_name": name, "__module__": name.rpartition(".")[0]})
    return _CLASSES[name]


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return standin(f"{self.__name__}.{name}")


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__file__ = f"<toolkit stand-in for the GPU library module {spec.name}>"
        RECORD["modules"].append(spec.name)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, libraries: Sequence[str]) -> None:
        self.libraries = frozenset(libraries)

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        # a top-level library, or a module under a package that is here but lacks it (a copy without its
        # compiled extensions: vllm._C); this finder is the last one asked, so what exists always wins
        if not any(fullname == name or fullname.startswith(name + ".") for name in self.libraries):
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)


def install(libraries: Sequence[str]) -> None:
    """Stand in for these top-level libraries where nothing installed provides them (idempotent)."""
    names = [n.strip() for n in libraries if n.strip()]
    if not names or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    RECORD["libraries"] = names
    sys.meta_path.append(_Finder(names))
    record_file = os.environ.get(RECORD_ENV)
    if record_file:
        atexit.register(lambda: Path(record_file).write_text(json.dumps(RECORD)))


SITECUSTOMIZE = '''\
"""Written by toolkit: stand-ins for the GPU libraries named in TOOLKIT_GPU_STANDINS (see toolkit_standins)."""
import os

if os.environ.get("TOOLKIT_GPU_STANDINS"):
    import toolkit_standins

    toolkit_standins.install(os.environ["TOOLKIT_GPU_STANDINS"].split(","))
'''


def site_dir(cache: Path) -> Path:
    """A folder to put first on the runtime's PYTHONPATH: this module as `toolkit_standins` and a sitecustomize
    that installs it when TOOLKIT_GPU_STANDINS is set (written once per content under `cache`)."""
    import hashlib

    source = Path(__file__).read_text(encoding="utf-8")
    key = hashlib.sha256((source + SITECUSTOMIZE).encode()).hexdigest()[:12]
    folder = cache / f"standins-{key}"
    if not (folder / "sitecustomize.py").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "toolkit_standins.py").write_text(source, encoding="utf-8")
        partial = folder / "sitecustomize.py.partial"
        partial.write_text(SITECUSTOMIZE, encoding="utf-8")
        partial.replace(folder / "sitecustomize.py")  # last: a folder without it is rewritten
    return folder


def environment(cache: Path, libraries: Sequence[str], paths: Sequence[Path]) -> dict[str, str]:
    """PYTHONPATH (the stand-ins' folder, then `paths`) and the variable that turns the stand-ins on."""
    return {"PYTHONPATH": os.pathsep.join([str(site_dir(cache)), *map(str, paths)]), ENV: ",".join(libraries)}
