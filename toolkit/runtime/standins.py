"""Import-safe stand-ins for the vendor image's GPU-only libraries (`base_image.gpu_libraries`: ixformer, xformers,
triton), so that a vendor tree that imports them at module level can be imported and configured on a CPU, and the
recipe's accelerators emulated (a pynvml that reports them, vLLM's device count), in every Python the runtime
starts: the sitecustomize applies both from the environment, so a child process (vLLM's registry check, a worker)
sees what its parent sees. Submodules the image lacks (`absent`) fail to import, as there.

Standard library only: the CPU runtime's Python loads this file through the `sitecustomize` that `site_dir()`
writes (activated by TOOLKIT_GPU_STANDINS, a comma-separated list of top-level names), from outside the tree, as
the preflight's stand-in pynvml is. A stand-in library is added at the end of the import path, so a library that
is really installed wins. Under it every submodule imports and every attribute resolves (to a class, so the tree
can subclass it, annotate with it and decorate with it at import time); a call from inside a function, the point
where the image would run GPU code, raises `StandInCalled` naming the library, the attribute and the caller's
file:line, except the functions that have a CPU reference (toolkit/runtime/references: the vendor's signature and
in-place semantics in plain torch), which compute, and are recorded with how often they ran.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import signal
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ENV = "TOOLKIT_GPU_STANDINS"  # the libraries to stand in, comma-separated
ABSENT_ENV = "TOOLKIT_GPU_ABSENT"  # submodules of them the image lacks (they fail to import), comma-separated
# prebuilt device kernels the tree imports (kind kernels: vllm.corex_gdn_causal_conv, ...), comma-separated: their
# files in the tree are device binaries that cannot load here, so these stand-ins are asked before the tree is
KERNELS_ENV = "TOOLKIT_DEVICE_KERNELS"
DEVICES_ENV = "TOOLKIT_EMULATED_DEVICES"  # JSON {"count", "memory_gb", "capability": [major, minor]}
CPU_DEVICE_ENV = "TOOLKIT_CPU_DEVICE"  # read by toolkit_cpu_device alone
RECORD_ENV = "TOOLKIT_GPU_STANDINS_RECORD"  # a file the record is written to at exit (JSON)
RECORD_PID_ENV = "TOOLKIT_GPU_STANDINS_RECORD_PID"  # set by the first Python that records: the others write FILE.PID
REFERENCES = Path(__file__).with_name("references")  # the CPU references (toolkit_references in the runtime)
CPU_DEVICE = Path(__file__).with_name("cpu_device.py")  # the GPU path on CPU tensors (toolkit_cpu_device there)
CENSUS = Path(__file__).with_name("census.py")  # what each step runs, counted (toolkit_census there)


class StandInCalled(RuntimeError):
    """The tree called a GPU library that only the image has."""


RECORD: dict[str, Any] = {"libraries": [], "modules": [], "calls": [], "absent": [], "absent_imports": [],
                         "devices": None, "patched": [], "patch_misses": [], "computed": {}}
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


def _reference(name: str) -> Callable[..., Any] | None:
    """The CPU reference of a stood-in function, if it has one (the registry is imported on the first call: torch
    comes with it)."""
    try:
        registry = importlib.import_module("toolkit_references")  # beside this file in the runtime
    except ModuleNotFoundError:
        registry = importlib.import_module("toolkit.runtime.references")  # the toolkit's own, in its tests
    found: Callable[..., Any] | None = registry.reference(name)
    return found


def _direct(name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return fn(*args, **kwargs)


Caller = Callable[[str, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
_caller: Caller = _direct


def call_references_through(caller: Caller) -> None:
    """Run every stand-in's CPU reference through `caller(name, reference, args, kwargs)` from now on in this
    process (the census counts each call as one vendor kernel)."""
    global _caller
    _caller = caller


class _StandInMeta(type):
    """The class of every stand-in attribute: attribute access gives more stand-ins, a call raises (or maps)."""

    _standin_name: str

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if _under(f"{cls._standin_name}.{name}", _StandInModule.absent):
            raise AttributeError(f"{cls._standin_name}.{name} is absent from the image")
        return standin(f"{cls._standin_name}.{name}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if "_standin_name" not in cls.__dict__:  # a class the tree derived from a stand-in: its own
            return super().__call__(*args, **kwargs)
        name = cls._standin_name
        caller = sys._getframe(1)
        where = _where(caller)
        if _at_definition_time(caller):
            # a decorator (or its factory) applied while a module or class is defined: stand in for the result
            return standin(f"{name}(...)")
        reference = _reference(name)
        if reference is not None:
            RECORD["calls"].append({"name": name, "where": where, "mapped": f"reference {name}"})
            out = _caller(name, reference, args, kwargs)
            # counted once it computed: a call its reference refused (a kernel's check) is not one that ran
            RECORD["computed"][name] = RECORD["computed"].get(name, 0) + 1
            return out
        RECORD["calls"].append({"name": name, "where": where, "mapped": None})
        library = next((n for n in RECORD["libraries"] if name == n or name.startswith(n + ".")), name.split(".")[0])
        if library in RECORD.get("kernels", ()):
            raise StandInCalled(f"{name} called from {where}: {library} is a prebuilt device kernel (kind kernels) "
                                "with no CPU reference of this function (toolkit/runtime/references)")
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
    absent: frozenset[str] = frozenset()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if _under(f"{self.__name__}.{name}", type(self).absent):
            raise AttributeError(f"{self.__name__}.{name} is absent from the image")
        return standin(f"{self.__name__}.{name}")


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__file__ = f"<toolkit stand-in for the GPU library module {spec.name}>"
        RECORD["modules"].append(spec.name)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _under(fullname: str, names: Sequence[str] | frozenset[str]) -> bool:
    return any(fullname == name or fullname.startswith(name + ".") for name in names)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, libraries: Sequence[str], absent: Sequence[str] = (), binaries: bool = False) -> None:
        self.libraries = frozenset(libraries)
        self.absent = frozenset(absent)
        self.binaries = binaries  # prebuilt kernels: stood in only where the tree holds the module's binary

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        # a top-level library, or a module under a package that is here but lacks it (a copy without its
        # compiled extensions: vllm._C); this finder is the last one asked, so what exists always wins
        if not _under(fullname, self.libraries):
            return None
        if self.binaries and fullname in self.libraries:
            # a kernel the tree does not hold (its transform skipped here) fails to import, as on the image
            leaf = fullname.rpartition(".")[2]
            if not any((Path(folder) / f"{leaf}.so").is_file() or next(Path(folder).glob(f"{leaf}.*.so"), None)
                       for folder in path or ()):
                return None
        if _under(fullname, self.absent):
            # the image lacks it: nothing provides it, and the import fails as it does there
            RECORD["absent_imports"].append(fullname)
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)


def install(libraries: Sequence[str], absent: Sequence[str] = (), kernels: Sequence[str] = ()) -> None:
    """Stand in for these top-level libraries where nothing installed provides them, except the absent submodules,
    and for these prebuilt kernel modules whatever the tree holds (idempotent)."""
    names = [n.strip() for n in libraries if n.strip()]
    device = [n.strip() for n in kernels if n.strip()]
    if not (names or device) or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    RECORD["libraries"] = names + device
    RECORD["kernels"] = device
    RECORD["absent"] = [n.strip() for n in absent if n.strip()]
    _StandInModule.absent = frozenset(RECORD["absent"])
    if names:
        sys.meta_path.append(_Finder(names, RECORD["absent"]))
    if device:
        sys.meta_path.insert(0, _Finder(device, binaries=True))
    _record_at_exit()


def _record_at_exit() -> None:
    """The first Python that records writes the record file at exit; every Python it starts (a worker, vLLM's
    engine process, a registry check) writes FILE.PID beside it, so none overwrites another (`read_record`)."""
    record_file = os.environ.get(RECORD_ENV)
    if not record_file or getattr(_record_at_exit, "registered", False):
        return
    _record_at_exit.registered = True  # type: ignore[attr-defined]
    os.environ.setdefault(RECORD_PID_ENV, str(os.getpid()))

    def terminated(signum: int, frame: types.FrameType | None) -> None:
        # a worker is stopped with SIGTERM (a daemon process at its parent's exit), perhaps inside a blocking C
        # call: record, then end as the signal would have, without waiting on anything
        _write_record()
        os._exit(128 + signum)

    atexit.register(_write_record)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, terminated)


def _write_record() -> None:
    """This process's record, to the record file if it is the first Python that records, else to FILE.PID."""
    record_file = os.environ.get(RECORD_ENV)
    if not record_file:
        return
    pid = os.getpid()  # when written, not when registered: a forked child is another process
    first = os.environ.get(RECORD_PID_ENV) == str(pid)
    target = Path(record_file if first else f"{record_file}.{pid}")
    partial = target.with_name(f"{target.name}.partial")
    partial.write_text(json.dumps(dict(RECORD, pid=pid)))
    partial.replace(target)


def read_record(record_file: Path) -> dict[str, Any]:
    """The record of the first Python, with every process it started under "processes" and the references that
    ran counted over all of them in "computed"."""
    record: dict[str, Any] = json.loads(record_file.read_text())
    children = [json.loads(p.read_text()) for p in sorted(record_file.parent.iterdir())
                if p.name.startswith(record_file.name + ".") and p.name.rpartition(".")[2].isdigit()]
    record["processes"] = children
    computed: dict[str, int] = dict(record.get("computed", {}))
    for child in children:
        for name, count in child.get("computed", {}).items():
            computed[name] = computed.get(name, 0) + count
    record["computed"] = computed
    return record


# -- the emulated devices ---------------------------------------------------------------------------------------

def emulated_nvml(count: int, memory_gb: float, capability: Sequence[int]) -> types.ModuleType:
    """A pynvml that reports the recipe's accelerators: vLLM takes the CUDA platform, as on the image, and its config
    code sees the devices it will see there (nothing touches a GPU)."""
    nvml = types.ModuleType("pynvml")
    nvml.__file__ = "<toolkit: emulated devices>"

    class NVMLError(Exception):
        pass

    class Memory:
        total = int(memory_gb * 2**30)
        free = total
        used = 0

    def handle(index: int) -> int:
        if not 0 <= index < count:
            raise NVMLError(f"no device {index}")
        return index

    major, minor = int(capability[0]), int(capability[1])
    values: dict[str, Any] = {
        "NVMLError": NVMLError, "nvmlInit": lambda: None, "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: count, "nvmlDeviceGetHandleByIndex": handle,
        "nvmlDeviceGetCudaComputeCapability": lambda h: (major, minor),
        "nvmlDeviceGetName": lambda h: "emulated accelerator", "nvmlDeviceGetMemoryInfo": lambda h: Memory(),
        "nvmlDeviceGetP2PStatus": lambda a, b, kind: 0, "NVML_P2P_CAPS_INDEX_NVLINK": 0, "NVML_P2P_STATUS_OK": 0,
    }
    for name, value in values.items():
        setattr(nvml, name, value)
    return nvml


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs patches right after a module is imported (the real module, found by the other finders)."""

    def __init__(self) -> None:
        self.patches: dict[str, list[Callable[[types.ModuleType], None]]] = {}

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        patches = self.patches.get(fullname)
        if not patches or (path is None and "." in fullname):  # a submodule is looked up in its package's path
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        exec_module = getattr(spec.loader, "exec_module", None) if spec is not None else None
        if spec is None or spec.loader is None or exec_module is None:
            RECORD["patch_misses"].append(fullname)  # said in the report: the emulation is incomplete there
            return None

        def patched(module: types.ModuleType) -> None:
            exec_module(module)
            for patch in patches:
                patch(module)
            RECORD["patched"].append(fullname)

        spec.loader.exec_module = patched  # type: ignore[method-assign]
        return spec


_HOOK = _AfterImport()


def after_import(module: str, patch: Callable[[types.ModuleType], None]) -> None:
    """Run `patch` on `module` once it is imported (now, if it already is): the one way the runtime changes a module
    from outside the tree."""
    if module in sys.modules:
        patch(sys.modules[module])
        RECORD["patched"].append(module)
        return
    if _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)
    _HOOK.patches.setdefault(module, []).append(patch)


def emulate(devices: dict[str, Any]) -> None:
    """The recipe's accelerators in this Python (idempotent): the pynvml above, and vLLM's stateless device count."""
    if RECORD["devices"] is not None:
        return
    count = int(devices["count"])
    sys.modules["pynvml"] = emulated_nvml(count, float(devices["memory_gb"]), devices.get("capability", (7, 0)))

    def device_count(vllm_utils: types.ModuleType) -> None:
        vllm_utils._cuda_device_count_stateless = lambda *args: count  # type: ignore[attr-defined]

    after_import("vllm.utils", device_count)
    after_import("vllm.model_executor.models.registry", _registry_check_forked)
    RECORD["devices"] = dict(devices)
    _record_at_exit()


# vLLM's registry inspects a lazily registered model class in a child process so that its parent never initialises
# CUDA (`_run_in_subprocess`: a fresh interpreter that imports torch and vLLM again, 6-8 s a check); here the child is
# a fork of the process that asks, which has no CUDA to protect (docs/preflight.md: the shim table)
REGISTRY_SHIM = "registry-check-forked"
# what a fork child accumulated by itself: the rest of the record (the libraries, the devices) is its parent's too
_PER_PROCESS = ("modules", "calls", "absent_imports", "patched", "patch_misses")


def _in_fork(fn: Callable[[], Any]) -> Any:
    """`fn()` in a fork of this process, as `_run_in_subprocess` runs it in a new one: its result, or a RuntimeError
    holding the child's traceback; the child writes its own record (its stand-in calls, its imports)."""
    import pickle
    import traceback

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the parent's code, never runs the parent's exit handlers
        code = 1
        try:
            os.close(read)
            for key in _PER_PROCESS:
                RECORD[key] = []
            RECORD["computed"] = {}
            RECORD.pop("load", None)  # the parent's load check, not this child's: a rank counts once
            try:
                payload = pickle.dumps((True, fn()))
            except BaseException:  # the parent raises it, as after a failed subprocess
                payload = pickle.dumps((False, traceback.format_exc()))
            with os.fdopen(write, "wb") as out:
                out.write(payload)
            _write_record()
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as incoming:
        payload = incoming.read()
    _, status = os.waitpid(pid, 0)
    if not payload:
        raise RuntimeError(f"Error raised in subprocess:\nthe forked registry check {pid} ended with wait status "
                           f"{status} and returned nothing")
    ok, value = pickle.loads(payload)
    if not ok:
        raise RuntimeError(f"Error raised in subprocess:\n{value}")
    return value


def _registry_check_forked(vllm_registry: types.ModuleType) -> None:
    original = vllm_registry._run_in_subprocess

    def forked(fn: Callable[[], Any]) -> Any:
        plugins = importlib.import_module("vllm.plugins")

        def run() -> Any:  # the plugins first, as `registry._run` loads them before it calls fn
            plugins.load_general_plugins()
            return fn()

        return _in_fork(run)

    forked.__wrapped__ = original  # type: ignore[attr-defined]  # the vendor's own, for a test to restore
    vllm_registry._run_in_subprocess = forked  # type: ignore[attr-defined]
    shim_applied(REGISTRY_SHIM)


def shim_applied(name: str) -> None:
    """A shim this process applied, in its record (once)."""
    if name not in RECORD.setdefault("shims", []):
        RECORD["shims"].append(name)


SITECUSTOMIZE = '''\
"""Written by toolkit: in every Python the runtime starts (children included), the stand-ins for the GPU libraries
named in TOOLKIT_GPU_STANDINS, the devices of TOOLKIT_EMULATED_DEVICES (see toolkit_standins), with
TOOLKIT_CPU_DEVICE the GPU path on CPU tensors (see toolkit_cpu_device) and with TOOLKIT_CENSUS the count of what
each step runs (see toolkit_census)."""
import json
import os

if os.environ.get("TOOLKIT_GPU_STANDINS") or os.environ.get("TOOLKIT_DEVICE_KERNELS"):
    import toolkit_standins

    toolkit_standins.install(os.environ.get("TOOLKIT_GPU_STANDINS", "").split(","),
                             os.environ.get("TOOLKIT_GPU_ABSENT", "").split(","),
                             os.environ.get("TOOLKIT_DEVICE_KERNELS", "").split(","))
DEVICES = json.loads(os.environ["TOOLKIT_EMULATED_DEVICES"]) if os.environ.get("TOOLKIT_EMULATED_DEVICES") else None
if DEVICES is not None:
    import toolkit_standins

    toolkit_standins.emulate(DEVICES)
if os.environ.get("TOOLKIT_CPU_DEVICE"):
    import toolkit_cpu_device

    try:
        toolkit_cpu_device.from_environment(os.environ, DEVICES)
    except toolkit_cpu_device.CpuDeviceError as exc:
        # refused, not ignored: Python prints a sitecustomize's exception and carries on without the shims
        import sys

        print(f"toolkit: {exc}", file=sys.stderr)
        os._exit(2)
if os.environ.get("TOOLKIT_CENSUS"):
    import toolkit_census

    try:
        toolkit_census.from_environment(os.environ)
    except toolkit_census.CensusError as exc:
        import sys

        print(f"toolkit: {exc}", file=sys.stderr)
        os._exit(2)
'''


def site_dir(cache: Path) -> Path:
    """A folder to put first on the runtime's PYTHONPATH: this module as `toolkit_standins` and a sitecustomize
    that installs it when TOOLKIT_GPU_STANDINS is set (written once per content under `cache`)."""
    from toolkit.pyenv import build_key  # the toolkit's side only: in the runtime this file runs on its own

    source = Path(__file__).read_text(encoding="utf-8")
    references = sorted(REFERENCES.glob("*.py"))
    folder = cache / f"standins-{build_key(SITECUSTOMIZE, files=[Path(__file__), CPU_DEVICE, CENSUS, *references])}"
    if not (folder / "sitecustomize.py").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "toolkit_standins.py").write_text(source, encoding="utf-8")
        (folder / "toolkit_cpu_device.py").write_text(CPU_DEVICE.read_text(encoding="utf-8"), encoding="utf-8")
        (folder / "toolkit_census.py").write_text(CENSUS.read_text(encoding="utf-8"), encoding="utf-8")
        (folder / "toolkit_references").mkdir(exist_ok=True)
        for reference in references:
            (folder / "toolkit_references" / reference.name).write_text(reference.read_text(encoding="utf-8"),
                                                                         encoding="utf-8")
        partial = folder / "sitecustomize.py.partial"
        partial.write_text(SITECUSTOMIZE, encoding="utf-8")
        partial.replace(folder / "sitecustomize.py")  # last: a folder without it is rewritten
    return folder


def environment(cache: Path, libraries: Sequence[str], paths: Sequence[Path], absent: Sequence[str] = (),
                devices: dict[str, Any] | None = None, cpu_device: bool = False,
                kernels: Sequence[str] = ()) -> dict[str, str]:
    """PYTHONPATH (the stand-ins' folder, then `paths`) and the variables that turn the stand-ins (the device
    emulation, and with `cpu_device` the GPU path on CPU tensors) on: inherited by every child process, whose
    sitecustomize applies the same."""
    env = {"PYTHONPATH": os.pathsep.join([str(site_dir(cache)), *map(str, paths)]), ENV: ",".join(libraries),
           ABSENT_ENV: ",".join(absent), KERNELS_ENV: ",".join(kernels)}
    if devices is not None:
        env[DEVICES_ENV] = json.dumps(devices)
    if cpu_device:
        env[CPU_DEVICE_ENV] = "on"
    return env
