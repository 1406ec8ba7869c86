"""Scripts the toolkit runs in another Python are isolated from their own folder, and its caches know what built
them (issue: a fresh machine could not build the tiny model because toolkit/bench/profile.py shadowed the standard
library's `profile`, which cProfile imports while torch loads; a warm cache hid it)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit import pyenv
from toolkit.bench import cpu_server
from toolkit.errors import InputError
from toolkit.runtime import env as runtime_env
from toolkit.runtime.preflight import STAGES

# every script the toolkit runs by path in another Python
SCRIPTS = (cpu_server.TINY_MODEL_SCRIPT, STAGES)
# the name that broke, one more that torch and vLLM import, and what the bootstrap itself imports (runpy is not
# frozen on 3.10, and it imports types)
ALWAYS_PLANTED = ("profile", "queue", "runpy", "types")


def _pythons() -> list[str]:
    """This Python and every other CPython 3.10+ that runs on this machine (the runtime may be 3.10, the image's
    is): on PATH, or installed by pyenv (whose shims answer only for the selected versions)."""
    candidates = [shutil.which(f"python3.{minor}") for minor in range(10, 15)]
    candidates += [str(p) for p in sorted(Path.home().glob(".pyenv/versions/3.1[0-9]*/bin/python3"))]
    found = {os.path.realpath(sys.executable): sys.executable}  # one run per interpreter, however it is reached
    for exe in filter(None, candidates):
        probe = subprocess.run([exe, "-c", "import sys; print(sys.version_info >= (3, 10))"], capture_output=True,
                               text=True)
        if probe.returncode == 0 and probe.stdout.strip() == "True":
            found.setdefault(os.path.realpath(exe), exe)
    return sorted(found.values())


PYTHONS = _pythons()


def _top_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names - {"__future__"}


def _plant(folder: Path, names: set[str]) -> None:
    for name in names:
        (folder / f"{name}.py").write_text(f"raise ImportError('shadowed: {name}')\n")


@pytest.mark.parametrize("python", PYTHONS)
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_siblings_cannot_shadow_the_standard_library(script: Path, python: str, tmp_path: Path) -> None:
    """The script beside modules named like every standard-library module it imports (and profile, queue, runpy,
    types), run from that folder as the toolkit runs it: none of them is imported. The plain `python script.py` is
    the control: there they are."""
    copy = tmp_path / script.name
    shutil.copy(script, copy)
    stdlib = {n for n in _top_imports(script) if n in sys.stdlib_module_names}
    _plant(tmp_path, stdlib | set(ALWAYS_PLANTED))
    plain = subprocess.run([python, str(copy)], capture_output=True, text=True, input="", timeout=120,
                           cwd=tmp_path)
    assert "shadowed:" in plain.stderr, "the control did not meet a planted module: the test plants nothing real"
    isolated = subprocess.run(pyenv.script(python, copy), capture_output=True, text=True, input="", timeout=120,
                              cwd=tmp_path)
    assert "shadowed:" not in isolated.stderr, isolated.stderr[-2000:]


@pytest.mark.parametrize("python", PYTHONS)
def test_isolated_code_ignores_the_working_directory(python: str, tmp_path: Path) -> None:
    _plant(tmp_path, {"queue", "profile", "runpy", "types"})
    source = "import cProfile, queue, sys\nprint(queue.__file__, cProfile.__file__, sys.argv[1:])\n"
    plain = subprocess.run([python, "-c", source], cwd=tmp_path, capture_output=True, text=True)
    assert "shadowed:" in plain.stderr
    proc = subprocess.run(pyenv.code(python, source, "a", "b"), cwd=tmp_path, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    queue_file, profile_file, args = proc.stdout.split(" ", 2)
    assert tmp_path not in (Path(queue_file).parent, Path(profile_file).parent) and args.strip() == "['a', 'b']"


def test_script_gets_its_arguments_and_exit_code(tmp_path: Path) -> None:
    """The bootstrap is invisible to the script: argv[0] is the script, __file__ is set, the exit code passes."""
    child = tmp_path / "child.py"
    child.write_text("import sys\nprint(sys.argv, __file__ == sys.argv[0], __name__)\nsys.exit(3)\n")
    proc = subprocess.run(pyenv.script(sys.executable, child, "x", "--y"), capture_output=True, text=True)
    assert proc.returncode == 3
    assert proc.stdout.strip() == f"[{str(child)!r}, 'x', '--y'] True __main__"


def test_build_key_sees_builders_files_pins(tmp_path: Path) -> None:
    builder = tmp_path / "builder.py"
    builder.write_text("one\n")
    base = pyenv.build_key("pin==1", files=[builder])
    assert pyenv.build_key("pin==1", files=[builder]) == base
    assert pyenv.build_key("pin==2", files=[builder]) != base
    (tmp_path / "empty.py").write_text("")
    assert pyenv.build_key("pin==1", files=[builder, tmp_path / "empty.py"]) != base  # a new (empty) file
    renamed = builder.rename(tmp_path / "other.py")
    assert pyenv.build_key("pin==1", files=[renamed]) != base  # the same bytes under another name
    renamed.rename(builder)
    builder.write_text("two\n")
    assert pyenv.build_key("pin==1", files=[builder]) != base
    # stable across processes (nothing in it depends on hash seeds or ids)
    code = ("from pathlib import Path; from toolkit import pyenv; "
            f"print(pyenv.build_key('pin==1', files=[Path({str(builder)!r})]))")
    keys = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert keys == {pyenv.build_key("pin==1", files=[builder])}

    def fill_a() -> None:
        pass

    def fill_b() -> None:
        print()

    assert pyenv.build_key(builders=[fill_a]) != pyenv.build_key(builders=[fill_b])


def test_environment_folders_are_keyed_by_how_they_are_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime's folder name changes with its pins and with its fill's source; a folder built by an older
    way is not found (built() is None)."""
    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path))
    before = runtime_env.built()
    assert before is None
    target = pyenv._target(runtime_env.KIND, runtime_env.NAME, runtime_env._fill, runtime_env.PINS)
    (target / "bin").mkdir(parents=True)
    (target / ".complete").write_text("ok\n")
    assert runtime_env.built() == target / "bin" / "python"
    monkeypatch.setattr(runtime_env, "PINS", (*runtime_env.PINS, "numpy<1.0"))
    assert runtime_env.built() is None


def test_tiny_model_builds_from_nothing(tmp_path: Path) -> None:
    """The tiny model built into a fresh folder with the CPU server's Python, every run (seconds), so a broken
    builder cannot hide behind a cached model."""
    python = cpu_server.environment()
    out = tmp_path / "tiny"
    cpu_server.build_tiny_model(python, out)
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= {p.name for p in out.iterdir()}


def test_a_failed_outlines_compile_names_the_step_and_the_error(tmp_path: Path) -> None:
    """The runtime's last build step run by a Python that has no outlines: an error that says which step failed and
    why (the end of its stderr), not a bare CalledProcessError."""
    with pytest.raises(InputError) as raised:
        runtime_env._outlines_compiled(Path(sys.executable), tmp_path, lambda text: None)
    said = str(raised.value)
    assert said.startswith("compiling outlines' numba functions in the new CPU runtime failed (exit 1):"), said
    assert "ModuleNotFoundError: No module named" in said and raised.value.hint.startswith("run again"), said


_SLOW_BUILD = """
import sys, time
from pathlib import Path
from toolkit.inputs import cached_tree

target, log = Path(sys.argv[1]), Path(sys.argv[2])

def build(tree, scratch):
    with log.open("a") as f:
        f.write("built\\n")
    time.sleep(3)
    tree.mkdir()
    (tree / "file").write_text("x")

got = cached_tree(target, build)
print((got / "file").read_text())
"""


def test_two_processes_asking_for_one_cache_folder_build_it_once(tmp_path: Path) -> None:
    """Two test workers fetched the reference wheel at once; the second one's rename replaced the folder while the
    first one's lint rule was reading it (FileNotFoundError in CI). One builds, the other waits and reads it."""
    target, log = tmp_path / "cache" / "thing", tmp_path / "builds.log"
    procs = [subprocess.Popen([sys.executable, "-c", _SLOW_BUILD, str(target), str(log)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert [out for out, _ in outputs] == ["x\n", "x\n"]
    waited = [err for _, err in outputs if f"waiting for another process that is building {target}" in err]
    assert len(waited) == 1, outputs  # the one that waited said so
    assert log.read_text() == "built\n"
    assert sorted(p.name for p in target.parent.iterdir()) == [".thing.lock", "thing"]


def test_a_cache_folder_without_its_marker_is_refused_and_kept(tmp_path: Path) -> None:
    from toolkit.inputs import cached_tree

    target = tmp_path / "thing"
    target.mkdir()
    (target / "theirs").write_text("kept")
    with pytest.raises(InputError) as raised:
        cached_tree(target, lambda tree, scratch: tree.mkdir())
    assert str(target) in str(raised.value) and "remove" in (raised.value.hint or "")
    assert (target / "theirs").read_text() == "kept"
