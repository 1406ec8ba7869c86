"""The model adapter as a pinned source: bundled from a clone or fetched at the pin, deployed, dispatched into.

On the adapter's files at the flagship's pin (tests/pinned_adapter.py), with the flagship recipe as it is committed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import git
import yaml
from conftest import FLAGSHIP, TRANSFORMERS_SITE, flagship_data, roots_of, transformers_site, tree_digest
from pinned_adapter import source_file

from toolkit import __version__
from toolkit.recipe import load_recipe
from toolkit.submission.render import render


def test_missing_local_source_is_a_clear_error(cli, corex_rootfs: Path) -> None:
    result = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs)
    assert result.code == 2
    assert "source 'qwen36-adapter' is not available here" in result.err
    assert "--source qwen36-adapter=PATH" in result.err


def test_wrong_pin_is_refused(cli, corex_rootfs: Path, adapter: tuple[Path, str]) -> None:
    clone, _ = adapter
    result = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, "--source", f"qwen36-adapter={clone}@{'0' * 40}")
    assert result.code == 2 and f"commit {'0' * 40} is not in" in result.err
    pinned = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, "--source", f"qwen36-adapter={clone}")
    assert pinned.code == 2 and "commit 2f7d5f5720863570d23d989ef8bbc7a387c606d4 is not in" in pinned.err


def test_a_no_checkout_clone_bundles_the_same_files(cli, corex_rootfs: Path, adapter: tuple[Path, str],
                                                    flagship_args: list[str], tmp_path: Path) -> None:
    clone, commit = adapter
    shallow = tmp_path / "no-checkout"
    git.Repo.clone_from(str(clone), str(shallow), no_checkout=True)
    assert not (shallow / "qwen3_6_scripts").exists()
    args = [a if not a.startswith("qwen36-adapter=") else f"qwen36-adapter={shallow}@{commit}" for a in flagship_args]
    result = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *args, "--dry-run", "--json")
    assert result.code == 0, result.out
    assert {r["state"] for r in result.json()["results"]} == {"WOULD_APPLY"}  # planned, not written


def test_bundled_build_carries_only_the_used_files(cli, corex_rootfs: Path, adapter: tuple[Path, str],
                                                  adapter_args: list[str], transformers_455: Path,
                                                  tmp_path: Path) -> None:
    _, commit = adapter
    out = tmp_path / "sub"
    result = cli("build", FLAGSHIP, "-o", out, *adapter_args, "--json")
    assert result.code == 0, result.err
    assert any(f"source qwen36-adapter: bundled at {commit}" in n for n in result.json()["notes"])
    assert result.json()["trial"]["untried"] == {}  # with the clone, the adapter's edits are tried too
    sources = out / "toolkit_payload/sources/qwen36-adapter"
    bundled = sorted(p.relative_to(sources).as_posix() for p in sources.rglob("*") if p.is_file())
    assert "wheels/transformers-4.55.3-py3-none-any.whl" not in bundled and "patch_ops.sh" not in bundled
    assert "qwen3_5.py" in bundled and "reasoning/qwen3_reasoning_parser.py" in bundled
    pinned_model = source_file("qwen3_5.py").replace(b"\r\n", b"\n")
    assert (sources / "qwen3_5.py").read_bytes().replace(b"\r\n", b"\n") == pinned_model, \
        "the pinned commit, not the work tree"
    assert b"\r" not in (sources / "protocol.py").read_bytes()
    digests = json.loads((out / "toolkit_payload/sources/qwen36-adapter.digests.json").read_text())
    assert sorted(digests) == bundled
    manifest = json.loads((out / "toolkit_payload/MANIFEST.json").read_text())
    assert "sources/qwen36-adapter/qwen3_5.py" in manifest["files"]
    assert manifest["toolkit_version"] == __version__
    assert (out / "toolkit_payload/packages/transformers-4.55.3-py3-none-any.whl").is_file()
    assert cli("check", out).code == 0
    site = transformers_site(corex_rootfs, transformers_455)
    recipe = out / "toolkit_payload/recipe/bi100-qwen36.yaml"
    env = dict(os.environ, PYTHONPATH=str(out / "toolkit_payload/src"))
    proc = subprocess.run([sys.executable, "-m", "toolkit.submission.inimage", str(recipe), "--rootfs",
                           str(corex_rootfs), "--package-root", f"transformers={site}"],
                          capture_output=True, text=True, cwd=out, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[ok] source qwen36-adapter: " in proc.stdout and "match their recorded sha256" in proc.stdout
    assert "[ok] moe-native /usr/local/corex/lib64/python3/dist-packages APPLIED" in proc.stdout
    assert f"[ok] adapter-transformers-config-mapping {site} APPLIED" in proc.stdout
    # a bundled file changed after the build: the in-image step refuses before touching anything
    (sources / "qwen3_5.py").write_text("tampered\n")
    again = subprocess.run([sys.executable, "-m", "toolkit.submission.inimage", str(recipe), "--rootfs",
                            str(corex_rootfs), "--package-root", f"transformers={site}", "--verify-only"],
                           capture_output=True, text=True, cwd=out, env=env)
    assert again.returncode == 1 and "[FAIL] source qwen36-adapter: 1 file(s) differ" in again.stdout


def test_fetch_mode_build_clones_and_verifies_the_pin(cli, tmp_path: Path) -> None:
    out = tmp_path / "sub"
    result = cli("build", FLAGSHIP, "-o", out, "--json")
    assert result.code == 0, result.err
    commit = "2f7d5f5720863570d23d989ef8bbc7a387c606d4"
    # no test reaches GitHub (conftest): the flagship's host-or-image source falls back to the image build, loudly
    assert any("NOT BUNDLED: THE IMAGE BUILD MUST CLONE" in n and f"at {commit}" in n for n in result.json()["notes"])
    # what needs the fetched adapter cannot be tried before writing: the report says so, by name
    untried = result.json()["trial"]["untried"]
    assert "adapter-model" in untried and "moe-native" in untried and "adapter-replace-protocol" in untried
    assert "unhardcode-enforce-eager" not in untried and "adapter-transformers-config-mapping" not in untried
    # in the words of the one check of a complete tree (the verbs that run the served code refuse it), with its fix
    said = [n for n in result.json()["notes"] if n.startswith("not tried here, tried by the in-image step instead")]
    assert len(said) == 1 and "need source(s) qwen36-adapter, which have no local files here" in said[0], said
    assert "to try them here, pass --source qwen36-adapter=PATH (a clone of https://github.com" in said[0]
    script = (out / "toolkit_payload/apply.sh").read_text()
    assert "git clone --quiet --no-checkout https://github.com/wudixzy/competition.git" in script
    assert f'!= "{commit}"' in script and 'mv "$clone/qwen3_6_scripts" "$src"' in script
    assert not (out / "toolkit_payload/sources").exists()
    assert json.loads(cli("check", out, "--json").out)["findings"] == []  # shellcheck and bash -n included


def test_fetch_mode_apply_sh_checks_out_the_subdir(tmp_path: Path, adapter: tuple[Path, str]) -> None:
    """The fetch step of apply.sh, run for real against a local clone URL: the pin, cut to its subdir."""
    clone, commit = adapter
    recipe = load_recipe(FLAGSHIP).recipe
    source = recipe.sources[0].model_copy(update={"git": f"file://{clone}", "commit": commit})
    script = render(recipe, "bi100-qwen36.yaml", None, [source]).apply_sh
    fetch = script[script.index("== toolkit: fetch source") - 6:script.index('echo "== toolkit: apply and verify')]
    payload = tmp_path / "payload"
    (payload / "sources").mkdir(parents=True)
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", f'payload={payload}\n{fetch}'],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fetched = payload / "sources/qwen36-adapter"
    pinned_model = source_file("qwen3_5.py").replace(b"\r\n", b"\n")
    assert (fetched / "qwen3_5.py").read_bytes().replace(b"\r\n", b"\n") == pinned_model
    assert not (fetched / ".git").exists()
    assert not (payload / "sources/.clone-qwen36-adapter").exists()
    bad = script.replace(commit, "1" * 40)
    fetch = bad[bad.index("== toolkit: fetch source") - 6:bad.index('echo "== toolkit: apply and verify')]
    shutil.rmtree(fetched)
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", f'payload={payload}\n{fetch}'],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "[FAIL] source qwen36-adapter" in proc.stdout


def test_version_read_from_version_py_without_metadata(cli, corex_rootfs: Path, flagship_args: list[str],
                                                       vllm_063: Path) -> None:
    for root in roots_of(corex_rootfs):
        for meta in root.glob("vllm-*.dist-info"):
            shutil.rmtree(meta)
        (root / "vllm/version.py").write_text('__version__ = "0.6.3"\n__version_tuple__ = (0, 6, 3)\n')
    result = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args, "--dry-run", "--json")
    assert result.code == 0, result.err
    assert any("vllm 0.6.3 (read from vllm/version.py)" in n for n in result.json()["notes"])
    # upstream's own version.py reads a _version.py the wheel does not ship, else falls back to "dev": no version
    upstream = (vllm_063 / "vllm/version.py").read_text()
    assert '__version__ = "dev"' in upstream
    for text in ("import os\n", upstream):
        for root in roots_of(corex_rootfs):
            (root / "vllm/version.py").write_text(text)
            (root / "vllm/_version.py").unlink(missing_ok=True)
        before = tree_digest(corex_rootfs)
        refused = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args)
        assert refused.code == 3 and "no vllm version in" in refused.err and "vllm/version.py" in refused.err
        assert "vllm-*.dist-info beside it" in refused.err
        assert tree_digest(corex_rootfs) == before


def test_transformers_root_must_be_given_on_a_host(cli, corex_rootfs: Path, adapter_args: list[str]) -> None:
    result = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *adapter_args)
    assert result.code == 2 and "package transformers: no roots here" in result.err
    assert "--package-root transformers=DIR" in result.err
    wrong = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *adapter_args,
                "--package-root", f"transformers={corex_rootfs / TRANSFORMERS_SITE / 'transformers'}")
    assert wrong.code == 2 and "not transformers/ itself" in wrong.err
    malformed = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *adapter_args, "--package-root", "transformers")
    assert malformed.code == 2 and "--package-root 'transformers': expected NAME=DIR" in malformed.err


def _flagship_copy(tmp_path: Path, edit: Any) -> Path:
    data = flagship_data()
    data["patches"] = str(FLAGSHIP.parent.parent / "patches/src")
    edit(data)
    path = tmp_path / "bi100-qwen36.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_fetch_mode_carries_the_digests_lock(cli, tmp_path: Path) -> None:
    lock = {"qwen3_5.py": "a" * 64}
    (tmp_path / "adapter.digests.json").write_text(json.dumps(lock))
    recipe = _flagship_copy(tmp_path, lambda d: d["sources"][0].update(digests="adapter.digests.json"))
    out = tmp_path / "sub"
    assert cli("build", recipe, "-o", out).code == 0
    assert json.loads((out / "toolkit_payload/sources/qwen36-adapter.digests.json").read_text()) == lock
    (tmp_path / "adapter.digests.json").write_text("{not json")
    broken = cli("build", recipe, "-o", tmp_path / "other")
    assert broken.code == 2 and "digests lock" in broken.err and not (tmp_path / "other").exists()


def test_a_replacement_of_a_folder_is_refused(cli, corex_rootfs: Path, flagship_args: list[str],
                                              tmp_path: Path) -> None:
    def folder(data: dict[str, Any]) -> None:
        replaced = next(t for t in data["transforms"] if t["id"] == "adapter-reasoning")
        replaced["replaces"] = "0" * 64

    result = cli("apply", _flagship_copy(tmp_path, folder), "--rootfs", corex_rootfs, *flagship_args)
    assert result.code == 2 and "`replaces` contracts one file" in result.err
