"""Declared git sources are fetched by the build host (into the cache, at the pinned commit, verified) and bundled:
the image build needs no git and no network. Real remotes on this machine: a file:// URL, git daemon on loopback,
an unreachable URL, a wrong commit, a force-pushed branch."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import git
import pytest
import yaml
from conftest import REPO, flagship_data
from pinned_adapter import make_repo

from toolkit.bench.serve import free_port
from toolkit.errors import InputError
from toolkit.pinned import mirror_path, resolve_pinned
from toolkit.recipe import load_recipe


@pytest.fixture(scope="module")
def remote(vllm_063: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A bare repository of the pinned adapter's files that this module's tests serve as a remote."""
    return make_repo(tmp_path_factory.mktemp("remote"))


def recipe_with(tmp_path: Path, url: str, commit: str, fetch: str = "host") -> Path:
    """The flagship with its adapter source at this URL and pin (fetch: host, the default, unless given)."""
    data = flagship_data()
    data["patches"] = str(REPO / "patches/src")
    data["sources"][0].update(git=url, commit=commit, fetch=fetch)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "bi100-qwen36.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def daemon(remote: tuple[Path, str]) -> Iterator[str]:
    """git daemon serving the remote's folder on a loopback port; stopped after the test."""
    bare, _ = remote
    port = free_port()
    proc = subprocess.Popen(["git", "daemon", "--reuseaddr", "--export-all", f"--base-path={bare.parent}",
                             "--listen=127.0.0.1", f"--port={port}", str(bare.parent)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        else:
            pytest.fail("git daemon did not listen")
        yield f"git://127.0.0.1:{port}/{bare.name}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def bundled_files(outdir: Path) -> list[str]:
    folder = outdir / "toolkit_payload/sources/qwen36-adapter"
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def test_build_fetches_a_file_url_once_and_bundles_it(cli, remote: tuple[Path, str], tmp_path: Path) -> None:
    bare, commit = remote
    url = f"file://{bare}"
    recipe = recipe_with(tmp_path / "r", url, commit)
    result = cli("build", recipe, "-o", tmp_path / "sub", "--json")
    assert result.code == 0, result.out[-3000:] + result.err[-3000:]
    assert f"source qwen36-adapter: cloning {url}" in result.err
    notes = result.json()["notes"]
    assert any(f"adapter source qwen36-adapter: bundled at {commit}" in n and "needs no git" in n for n in notes)
    assert not [i for i in result.json()["issues"] if i["rule"] == "source-fetch"]
    files = bundled_files(tmp_path / "sub")
    assert "qwen3_5.py" in files and "patch_ops.sh" not in files  # only what the recipe uses
    assert "fetch source" not in (tmp_path / "sub/toolkit_payload/apply.sh").read_text()
    assert (mirror_path(load_recipe(recipe).recipe.sources[0]) / "HEAD").is_file()
    # a second build fetches nothing: the remote is gone and it still builds the same tree
    moved = bare.with_name("away.git")
    bare.rename(moved)
    try:
        again = cli("build", recipe, "-o", tmp_path / "sub2", "--json")
    finally:
        moved.rename(bare)
    assert again.code == 0, again.out[-3000:] + again.err[-3000:]
    assert "cloning" not in again.err and "fetching" not in again.err
    assert again.json()["tree"] == result.json()["tree"]


def test_build_fetches_from_git_daemon(cli, remote: tuple[Path, str], daemon: str, tmp_path: Path) -> None:
    _, commit = remote
    result = cli("build", recipe_with(tmp_path / "r", daemon, commit), "-o", tmp_path / "sub", "--json")
    assert result.code == 0, result.out[-3000:] + result.err[-3000:]
    assert f"source qwen36-adapter: cloning {daemon}" in result.err
    assert "qwen3_5.py" in bundled_files(tmp_path / "sub")


def test_an_unreachable_source_fails_the_build_naming_url_and_fix(cli, remote: tuple[Path, str],
                                                                  tmp_path: Path) -> None:
    _, commit = remote
    url = f"git://127.0.0.1:{free_port()}/adapter.git"  # nothing listens there
    result = cli("build", recipe_with(tmp_path / "r", url, commit), "-o", tmp_path / "sub", "--json")
    assert result.code == 2 and not (tmp_path / "sub").exists()
    error = result.json()
    assert f"source qwen36-adapter: cannot clone {url}" in error["error"], error
    assert "--source qwen36-adapter=PATH" in error["fix"]


def test_host_or_image_falls_back_loudly_and_check_and_lint_say_so(cli, remote: tuple[Path, str],
                                                                    tmp_path: Path) -> None:
    _, commit = remote
    url = f"git://127.0.0.1:{free_port()}/adapter.git"
    recipe = recipe_with(tmp_path / "r", url, commit, fetch="host-or-image")
    result = cli("build", recipe, "-o", tmp_path / "sub", "--json")
    assert result.code == 0, result.out[-3000:] + result.err[-3000:]
    assert "the IMAGE BUILD will clone" in result.err
    report = result.json()
    assert any("NOT BUNDLED: THE IMAGE BUILD MUST CLONE" in n and "this host could not reach it" in n
               for n in report["notes"])
    assert [i["severity"] for i in report["issues"] if i["rule"] == "source-fetch"] == ["warning"]
    assert f"fetch source qwen36-adapter at {commit}" in (tmp_path / "sub/toolkit_payload/apply.sh").read_text()
    checked = cli("check", tmp_path / "sub", "--json")
    assert checked.code == 0
    warned = [i for i in checked.json()["issues"] if i["rule"] == "source-fetch"]
    assert len(warned) == 1 and "needs git and network" in warned[0]["message"]
    said = cli("lint", recipe, "--verbose", "--json").json()["issues"]
    assert [i["severity"] for i in said if i["rule"] == "source-fetch"] == ["info"]
    image = cli("lint", recipe_with(tmp_path / "i", url, commit, fetch="image"), "--json").json()["issues"]
    assert [i["severity"] for i in image if i["rule"] == "source-fetch"] == ["warning"]


def test_a_wrong_commit_is_refused(remote: tuple[Path, str], tmp_path: Path) -> None:
    bare, _ = remote
    wrong = "0" * 40
    loaded = load_recipe(recipe_with(tmp_path, f"file://{bare}", wrong))
    with pytest.raises(InputError) as info:
        resolve_pinned(loaded.recipe, loaded.path.parent, {}, fetch=True)
    assert f"the pinned commit {wrong} is not in file://{bare}" in info.value.message


def test_a_force_pushed_pin_resolves_while_it_exists_and_says_so_when_gone(vllm_063: Path, tmp_path: Path) -> None:
    bare, pinned = make_repo(tmp_path / "fp")
    url = f"file://{bare}"

    def force_push() -> None:  # the branch rewritten: the pinned commit is no longer reachable from any ref
        work = git.Repo(bare.parent / "adapter-work")
        work.git.checkout("--", ".")
        (bare.parent / "adapter-work/README.md").write_text("rewritten\n")
        work.git.add("--all")
        work.git.commit("--amend", "-m", "rewritten")
        work.git.push("--force", str(bare), "HEAD:refs/heads/newest")  # the branch make_repo pushed the pin to

    def resolve(where: Path) -> str:
        loaded = load_recipe(recipe_with(where, url, pinned))
        _, commits = resolve_pinned(loaded.recipe, loaded.path.parent, {}, fetch=True)
        return commits["qwen36-adapter"]

    assert resolve(tmp_path / "a") == pinned  # cached in the mirror before the force-push
    force_push()
    assert resolve(tmp_path / "b") == pinned  # the mirror keeps it: no network needed
    shutil.rmtree(mirror_path(load_recipe(tmp_path / "a/bi100-qwen36.yaml").recipe.sources[0]))
    assert resolve(tmp_path / "c") == pinned  # a fresh clone: the server still hands it out by its id
    shutil.rmtree(mirror_path(load_recipe(tmp_path / "a/bi100-qwen36.yaml").recipe.sources[0]))
    subprocess.run(["git", "-C", str(bare), "reflog", "expire", "--expire=now", "--all"], check=True)
    subprocess.run(["git", "-C", str(bare), "gc", "--quiet", "--prune=now"], check=True)
    with pytest.raises(InputError) as info:
        resolve(tmp_path / "d")
    assert "no branch or tag reaches it" in info.value.message and "--source qwen36-adapter=PATH" in info.value.hint


def test_the_adapters_commit_before_the_upgrade_is_refused_by_build_naming_what_drifted(cli, vllm_063: Path,
                                                                            tmp_path: Path) -> None:
    """The adapter's commit before the upgrade (5a1c8c7, byte for byte from shared/, the first commit of the
    suite's repository of its history): the trial tries every transform on its files and build refuses it naming
    exactly the transforms whose anchors the upgrade moved, in both roots, writing nothing. A change here is a change
    in what the anchors see."""
    from pinned_adapter import history

    clone, before, _ = history(tmp_path / "repo")
    out = tmp_path / "sub"
    # the prebuilt kernels came with 2f7d5f5: at 5a1c8c7 their folder is not there, said before anything is tried
    refused = cli("build", REPO / "recipes" / "bi100-qwen36.yaml", "-o", out, "--source",
                  f"qwen36-adapter={clone}@{before}", "--json")
    assert refused.code == 2 and not out.exists(), refused.out[-2000:] + refused.err[-2000:]
    assert "prebuilt/corex-3.2.3-ivcore10 is not in commit" in refused.json()["error"], refused.json()
    # without them (and the guard of their call site) every other transform is tried on the old files
    data = flagship_data()
    data["patches"] = str(REPO / "patches" / "src")
    data["transforms"] = [t for t in data["transforms"]
                          if t["id"] not in ("adapter-corex-kernels", "adapter-corex-causal-conv-guard")]
    recipe = tmp_path / "bi100-qwen36.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    result = cli("build", recipe, "-o", out, "--source", f"qwen36-adapter={clone}@{before}", "--json")
    assert result.code != 0 and not out.exists(), result.out[-2000:] + result.err[-2000:]
    results = result.json()["results"]
    drifted = {(r["transform"], r["root"]) for r in results if r["state"] == "DRIFTED"}
    roots = {r["root"] for r in results if r["transform"] == "prefix-state-no-block-id-save"}
    assert len(roots) == 2, roots
    assert drifted == {(t, root) for t in ("prefix-state-no-adapter-capture", "prefix-state-no-block-id-save",
                                            "probe-moe-router", "probe-attention-qgkv-proj") for root in roots}, \
        sorted(drifted)
