"""Shared fixtures: real vLLM releases fetched by pip (cached), CoreX-like trees, the CLI."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pinned_adapter
import pytest
import yaml

from toolkit.cli import main
from toolkit.corexlike import COREX_BASE, COREX_ROOTS, corexify, make_rootfs
from toolkit.inputs import fetch_reference

REPO = Path(__file__).resolve().parent.parent


GITCONFIG = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    """No test reaches GitHub, on any machine: the flagship's adapter URL (and any other github.com URL) is
    rewritten by git to a folder that does not exist, so `toolkit build` without --source meets an unreachable
    source the same way everywhere, and the real third-party adapter is never fetched. Tests that want a remote
    serve one themselves (file:// or git daemon on loopback)."""
    gitconfig = Path(tempfile.mkdtemp(prefix="toolkit-tests-git-")) / "gitconfig"
    gitconfig.write_text('[url "file:///nonexistent/github.com/"]\n\tinsteadOf = https://github.com/\n'
                         "[user]\n\tname = toolkit tests\n\temail = tests@localhost\n")
    os.environ["GIT_CONFIG_GLOBAL"] = str(gitconfig)
    config.stash[GITCONFIG] = gitconfig.parent
    # two workers on two cores: a process with more OpenMP threads than its share spins them against the other
    # worker's (measured: test_generate and test_prefix_state side by side took 351 s, with one thread each 181 s)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(GITCONFIG, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)  # made by pytest_configure above


# seconds of setup, call and teardown per test file, summed where the reports arrive (xdist's controller): the
# table that shows which file grew in the run that made it grow
FILE_SECONDS: dict[str, float] = {}
SLOWEST_FILES = 15


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    file = report.nodeid.split("::", 1)[0]
    FILE_SECONDS[file] = FILE_SECONDS.get(file, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if not FILE_SECONDS:
        return
    servers = sum(t for file, t in FILE_SECONDS.items() if Path(file).name in SERVER_FILES)
    terminalreporter.section(f"the {SLOWEST_FILES} slowest test files (setup + call + teardown)")
    for file, seconds in sorted(FILE_SECONDS.items(), key=lambda item: -item[1])[:SLOWEST_FILES]:
        scope = "  (servers' worker)" if Path(file).name in SERVER_FILES else ""
        terminalreporter.write_line(f"{seconds:8.1f} s  {file}{scope}")
    terminalreporter.write_line(f"{sum(FILE_SECONDS.values()):8.1f} s  all files, summed over the workers; "
                                f"{servers:.1f} s of it in the server files, which run one after another")


# the files whose tests start servers (or an estimate's engine): one xdist scope, so no two of them run at once (a
# rehearsal and an estimate refuse to start beside another server, and each file's stray-process checks would count
# the other worker's)
SERVER_FILES = frozenset({"test_bench_experiment.py", "test_bench_server.py", "test_rehearse.py",
                          "test_estimate_census.py"})


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile`, with the server files sent to one worker together."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ServersTogether(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return "servers" if Path(file).name in SERVER_FILES else file

    return ServersTogether(config, log)


FLAGSHIP = REPO / "recipes" / "bi100-qwen36.yaml"


def flagship_data() -> dict[str, Any]:
    """The flagship as its layers compose it (a fresh copy): what a test edits and writes out as one recipe file
    (`patches: toolkit:` holds wherever that file is)."""
    import copy

    from toolkit.recipe import load_recipe

    return copy.deepcopy(load_recipe(FLAGSHIP).located.data)


class _RecipeStyle(yaml.SafeDumper):
    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)  # list items indented under their key, as the recipes write them


def yaml_text(data: Any, **options: Any) -> str:
    """yaml.safe_dump through libyaml's emitter: the same document (it folds long strings elsewhere), 7x faster; a
    flagship-sized recipe took 45 ms in PyYAML's, and the fuzz and lint tests write hundreds."""
    return yaml.dump(data, Dumper=yaml.CSafeDumper, **options)


def recipe_text(data: dict[str, Any]) -> str:
    """A recipe as one YAML file, in the committed recipes' layout (lists indented, no folding)."""
    return yaml.dump(data, Dumper=_RecipeStyle, sort_keys=False, allow_unicode=True, width=10_000)


def flagship_origin(needle: str, after: str | None = None) -> tuple[str, int]:
    """(file, line) of the first line holding `needle` (after the first holding `after`) in the flagship's layers,
    as a report's recipe_file / recipe_line name it."""
    from toolkit.recipe import load_recipe

    for layer in load_recipe(FLAGSHIP).layers:
        lines = Path(layer).read_text().splitlines()
        start = next((i for i, ln in enumerate(lines) if after in ln), None) if after else 0
        if start is None:
            continue
        found = next((i + 1 for i, ln in enumerate(lines) if i >= start and needle in ln), None)
        if found:
            return layer, found
    raise AssertionError(f"{needle!r} is in no layer of {FLAGSHIP}")

# where the image's transformers lives (the adapter's handoff log); found there with find_spec, not declared
TRANSFORMERS_SITE = "usr/local/lib/python3.10/site-packages"
TRANSFORMERS_FILES = ("transformers/__init__.py", "transformers/models/__init__.py",
                      "transformers/models/auto/configuration_auto.py")


@pytest.fixture(scope="session")
def vllm_063() -> Path:
    """vLLM 0.6.3, the true public base of the CoreX build (about 195 MB, fetched once, cached)."""
    return fetch_reference(COREX_BASE)


@pytest.fixture(scope="session")
def vllm_063_post1() -> Path:
    """vLLM 0.6.3.post1, the release the CoreX build was once taken to be based on."""
    return fetch_reference("vllm==0.6.3.post1")


@pytest.fixture(scope="session")
def vllm_085() -> Path:
    """vLLM 0.8.5.post1: a later release where scopes moved and some patches are upstream."""
    return fetch_reference("vllm==0.8.5.post1")


@pytest.fixture(scope="session")
def corex_template(vllm_063: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_rootfs(vllm_063, tmp_path_factory.mktemp("corex-template") / "rootfs")


@pytest.fixture(scope="session")
def transformers_455() -> Path:
    """transformers 4.55.3, the version the adapter needs and the image holds (fetched once, cached)."""
    return fetch_reference("transformers==4.55.3")


@pytest.fixture(scope="session")
def adapter_before(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A bare repository of the adapter's history (tests/pinned_adapter.py) and its commit of 5a1c8c7's files, the
    flagship's pin before the upgrade."""
    clone, before, _ = pinned_adapter.history(tmp_path_factory.mktemp("adapter-before"))
    return clone, before


def flagship_before_the_upgrade(work: Path) -> Path:
    """The flagship as it was at 5a1c8c7: today's recipe and layers, with the adapter layer as it was before the
    upgrade (tests/data: the layer this repository had, which `toolkit upgrade --write` started from)."""
    for folder in ("recipes", "layers"):
        shutil.copytree(REPO / folder, work / folder)
    shutil.copy(REPO / "tests" / "data" / "qwen36-adapter-5a1c8c7.yaml", work / "layers" / "qwen36-adapter.yaml")
    # its model was a text model then (5a1c8c7 skips the vision tower), which vLLM serves without an image limit
    recipe = work / "recipes" / "bi100-qwen36.yaml"
    text = recipe.read_text(encoding="utf-8")
    for line in ("    limit-mm-per-prompt: image=6\n", "    args:\n      limit-mm-per-prompt: image=1\n"):
        assert line in text, line
        text = text.replace(line, "")
    recipe.write_text(text, encoding="utf-8")
    return recipe


@pytest.fixture(scope="session")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A bare repository of the model adapter's files at the flagship's pin (tests/pinned_adapter.py) and its
    commit."""
    return pinned_adapter.make_repo(tmp_path_factory.mktemp("adapter"))


def transformers_site(rootfs: Path, transformers: Path, full: bool = False) -> Path:
    """The files of transformers the flagship edits (full: the whole package, for running it), with its metadata,
    where the image keeps it."""
    site = rootfs / TRANSFORMERS_SITE
    if full:
        shutil.copytree(transformers / "transformers", site / "transformers", dirs_exist_ok=True)
    for rel in TRANSFORMERS_FILES:
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(transformers / rel, site / rel)
    for meta in transformers.glob("transformers-*.dist-info"):
        shutil.copytree(meta, site / meta.name, dirs_exist_ok=True)
    return site


@pytest.fixture(scope="session")
def adapter_args(adapter: tuple[Path, str]) -> list[str]:
    """The pinned adapter's files from the suite's own repository of them (the fixture's replaced files are the
    real image's: no --expect swap)."""
    clone, commit = adapter
    return ["--source", f"qwen36-adapter={clone}@{commit}"]


@pytest.fixture
def flagship_args(adapter_args: list[str], corex_rootfs: Path, transformers_455: Path) -> list[str]:
    """What the flagship needs on the fixture: the pinned adapter and transformers."""
    site = transformers_site(corex_rootfs, transformers_455)
    return [*adapter_args, "--package-root", f"transformers={site}"]


@pytest.fixture
def corex_rootfs(corex_template: Path, tmp_path: Path) -> Path:
    """A fresh CoreX-like image filesystem (both vLLM roots) for one test."""
    target = tmp_path / "rootfs"
    shutil.copytree(corex_template, target, symlinks=True)
    return target


def small_rootfs(reference: Path, rootfs: Path, files: list[str], *, corex: bool = True) -> Path:
    """Like make_rootfs, with only the listed vllm files (fast, for per-kind tests)."""
    staging = rootfs.parent / f".{rootfs.name}-staging"
    for rel in files:
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(reference / rel, staging / rel)
    (staging / "vllm" / "__init__.py").touch()
    for meta in reference.glob("vllm-*.dist-info"):
        shutil.copytree(meta, staging / meta.name, dirs_exist_ok=True)
    if corex:
        corexify(staging, only_present=True)
    make_rootfs(staging, rootfs, corex=False)
    shutil.rmtree(staging)
    return rootfs


def tree_digest(root: Path) -> dict[str, str]:
    """Every file, link and folder under root with its content hash (to prove nothing changed)."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = "link:" + str(path.readlink())
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


@dataclass
class CliResult:
    code: int
    out: str
    err: str

    def json(self) -> dict:  # type: ignore[type-arg]
        return json.loads(self.out)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., CliResult]:
    def run(*argv: str | Path) -> CliResult:
        capsys.readouterr()
        code = main([str(a) for a in argv])
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


def roots_of(rootfs: Path) -> list[Path]:
    return [rootfs / r.lstrip("/") for r in COREX_ROOTS]


@pytest.fixture(scope="module")
def engine() -> Any:
    """A reachable Docker engine; without one the test skips and says why, or fails under TOOLKIT_REQUIRE_DOCKER=1
    (set by .ci/run: CI must have an engine)."""
    import docker

    try:
        client = docker.from_env()
        client.ping()
    except Exception as exc:
        reason = f"no Docker engine reachable at {os.environ.get('DOCKER_HOST', 'the default socket')}: {exc}"
        if os.environ.get("TOOLKIT_REQUIRE_DOCKER") == "1":
            pytest.fail(reason + " (TOOLKIT_REQUIRE_DOCKER=1: CI must have an engine)")
        pytest.skip(reason)
    return client


def switch_package(patches: Path, package: str, flags: dict[str, str]) -> Path:
    """A patches package that can be dispatched into: the toolkit's strict switch reader beside a table listing
    `flags` (name -> default) as dispatch flags."""
    folder = patches / package
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__init__.py").touch()
    shutil.copy(REPO / "patches" / "src" / "native_fastpaths" / "switches.py", folder / "switches.py")
    (folder / "switches.json").write_text(json.dumps(
        {name: {"default": default, "kind": "dispatch", "type": "flag", "selects": "a test's fast path"}
         for name, default in flags.items()}))
    return folder
