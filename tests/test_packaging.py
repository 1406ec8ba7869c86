"""The toolkit as people install it: a wheel built by the build backend, installed into a fresh venv that cannot
see this checkout, run from another folder on a recipe kept outside the checkout (`patches: toolkit:`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import REPO, flagship_data

from toolkit import __version__
from toolkit.resources import LAYOUT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    print("building the toolkit's wheel with pip (the build backend, hatchling, is fetched into pip's build env)",
          file=sys.stderr)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-q",
                           "-w", str(out), str(REPO)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = out.glob("vllm_recipe_toolkit-*.whl")
    return built


def runtime_files() -> set[str]:
    """Every file the toolkit opens at run time, where the wheel must hold it: its modules (the stages script and the
    stand-ins are run as files too) and LAYOUT's resources under toolkit/_data."""
    files = {p.relative_to(REPO).as_posix() for p in (REPO / "toolkit").rglob("*.py") if "__pycache__" not in p.parts}
    for name, rel in LAYOUT.items():
        source = REPO / rel
        for path in [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file()):
            if "__pycache__" in path.parts or path.suffix == ".pyc":
                continue
            files.add(f"toolkit/_data/{name}" + ("" if path == source else "/" + path.relative_to(source).as_posix()))
    return files


def test_the_wheel_holds_every_file_the_toolkit_reads(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(runtime_files() - names)
    assert missing == []
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    assert wheel.name.startswith(f"vllm_recipe_toolkit-{__version__}-")


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv (no system site-packages, not this checkout) with the wheel and its dependencies."""
    env_dir = tmp_path_factory.mktemp("venv") / "toolkit"
    print(f"installing the wheel and its dependencies into a fresh venv {env_dir} (pip, from its cache)",
          file=sys.stderr)
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return env_dir


def run_installed(env_dir: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{env_dir / 'bin'}:{env.get('PATH', '')}"
    return subprocess.run(list(argv), capture_output=True, text=True, cwd=cwd, env=env)


def scratch_recipe(folder: Path) -> Path:
    """The flagship, kept in a user's own folder: it deploys the toolkit's own patches (`patches: toolkit:`)."""
    data = flagship_data()
    data["patches"] = "toolkit:"
    folder.mkdir(parents=True)
    path = folder / "bi100-qwen36.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_installed_from_the_wheel_it_builds_and_checks_from_any_folder(installed: Path, tmp_path: Path,
                                                                        cli) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = run_installed(installed, "python", "-c", "import toolkit; print(toolkit.__file__)", cwd=elsewhere)
    assert where.returncode == 0 and str(installed) in where.stdout and str(REPO) not in where.stdout
    for argv in (["toolkit", "--version"], ["python", "-m", "toolkit", "--version"]):
        shown = run_installed(installed, *argv, cwd=elsewhere)
        assert shown.returncode == 0 and shown.stdout.strip() == f"toolkit {__version__}", shown
    recipe = scratch_recipe(tmp_path / "my-recipes")
    built = run_installed(installed, "toolkit", "build", str(recipe), "-o", str(tmp_path / "from-wheel"), "--json",
                          cwd=elsewhere)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    checked = run_installed(installed, "toolkit", "check", str(tmp_path / "from-wheel"), cwd=elsewhere)
    assert checked.returncode == 0, checked.stdout[-3000:]
    # the editable install (this checkout) writes the same tree and commit for the same inputs
    here = cli("build", recipe, "-o", tmp_path / "from-checkout", "--json")
    assert here.code == 0, here.err[-3000:]
    wheel_report = json.loads(built.stdout)
    assert (wheel_report["tree"], wheel_report["commit"]) == (here.json()["tree"], here.json()["commit"])
    assert wheel_report["toolkit_version"] == __version__


def test_toolkit_patches_resolve_to_the_installed_copy_and_a_bad_folder_is_named(tmp_path: Path, cli) -> None:
    from toolkit.recipe import load_recipe
    from toolkit.resources import resource

    recipe = scratch_recipe(tmp_path / "r")
    assert load_recipe(recipe).patches_dir == resource("patches")
    assert (resource("patches") / "native_fastpaths" / "switches.json").is_file()
    data = yaml.safe_load(recipe.read_text())
    data["patches"] = "./no-such-folder"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    result = cli("build", recipe, "-o", tmp_path / "sub", "--json")
    assert result.code == 2 and not (tmp_path / "sub").exists()
    assert "no-such-folder" in result.json()["error"]
