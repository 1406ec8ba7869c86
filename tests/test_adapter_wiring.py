"""The model adapter as a pinned source: bundle or fetch, deploy, dispatch into it; on a stand-in adapter."""

from __future__ import annotations

import copy
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import git
import pytest
import yaml
from conftest import FLAGSHIP, REPO, roots_of, small_rootfs, tree_digest
from standin_adapter import SOURCE

torch = pytest.importorskip("torch", reason="the dispatch tests import the patched adapter: pip install torch==2.13.0")

ADAPTER_FILE = "vllm/model_executor/models/qwen3_5.py"
PROV = {"why": "native fast path for the stand-in adapter", "remove_when": "the adapter ships it"}


def dispatch(tid: str, scope: str, switch: str, target: str, **extra: Any) -> dict[str, Any]:
    return {"id": tid, "kind": "dispatch", "file": ADAPTER_FILE, "scope": scope, "switch": switch,
            "target": target, **PROV, **extra}


WIRING = [
    {"id": "deploy-adapter-model", "kind": "deploy", "source": "@stand-in/qwen3_5.py", "dest": ADAPTER_FILE, **PROV},
    dispatch("moe-native", "Qwen3_5MoeSparseBlock._pure_pytorch_experts", "MOE_NATIVE",
             "native_fastpaths.moe:pure_pytorch_experts"),
    dispatch("chunk-parallel", "_torch_chunk_gated_delta_rule", "CHUNK_PARALLEL",
             "native_fastpaths.gdn:torch_chunk_gated_delta_rule"),
    dispatch("loop1-native", "_torch_recurrent_gated_delta_rule", "LOOP1_NATIVE",
             "native_fastpaths.gdn:torch_recurrent_gated_delta_rule"),
    dispatch("rmsnorm-native", "Qwen3_5RMSNormGated.forward", "RMSNORM_NATIVE",
             "native_fastpaths.norm:qwen3_5_rmsnorm_gated_forward"),
]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    repo_dir = tmp_path_factory.mktemp("adapter") / "qwen36_01"
    repo = git.Repo.init(repo_dir)
    (repo_dir / "qwen3_5.py").write_text(SOURCE)
    (repo_dir / "README.md").write_text("stand-in adapter\n")
    repo.index.add(["qwen3_5.py", "README.md"])
    actor = git.Actor("t", "t@t")
    commit = repo.index.commit("stand-in adapter", author=actor, committer=actor).hexsha
    (repo_dir / "qwen3_5.py").write_text(SOURCE + "\nraise RuntimeError('uncommitted edit')\n")  # must not leak
    return repo_dir, commit


def write_recipe(tmp_path: Path, commit: str, path: str | None) -> Path:
    data = copy.deepcopy(yaml.safe_load(FLAGSHIP.read_text()))
    data["patches"] = str(REPO / "patches" / "src")
    source = {"name": "stand-in", "git": "https://adapter.invalid/qwen36_01.git", "commit": commit,
              "provides_flags": ["reasoning-parser"], "provides_tool_parsers": ["qwen3_coder"]}
    if path:
        source["path"] = path
    data["sources"] = [source]
    data["transforms"] += copy.deepcopy(WIRING)
    data["env"].update({"MOE_NATIVE": "1", "CHUNK_PARALLEL": "1", "LOOP1_NATIVE": "1", "RMSNORM_NATIVE": "1"})
    data.pop("variants"), data.pop("matrix")
    recipe = tmp_path / "wired.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    return recipe


@pytest.fixture
def tree(vllm_063: Path, tmp_path: Path) -> Path:
    files = sorted({t["file"] for t in yaml.safe_load(FLAGSHIP.read_text())["transforms"] if "file" in t})
    return small_rootfs(vllm_063, tmp_path / "rootfs", files)


def states(result: Any) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for r in result.json()["results"]:
        out.setdefault(r["transform"], set()).add(r["state"])
    return out


def test_apply_deploys_and_patches_the_adapter(cli, adapter: tuple[Path, str], tree: Path, tmp_path: Path) -> None:
    path, commit = adapter
    recipe = write_recipe(tmp_path, commit, None)
    first = cli("apply", recipe, "--rootfs", tree, "--source", f"stand-in={path}", "--json")
    assert first.code == 0, first.out
    got = states(first)
    assert got["moe-native"] == {"APPLIED"} and got["deploy-adapter-model"] == {"APPLIED"}
    for root in roots_of(tree):
        text = (root / ADAPTER_FILE).read_text()
        assert "uncommitted edit" not in text, "the pinned commit is deployed, not the working tree"
        assert 'environ.get("MOE_NATIVE", "1")' in text and "# toolkit-marker: rmsnorm-native" in text
    snapshot = tree_digest(tree)
    again = cli("apply", recipe, "--rootfs", tree, "--source", f"stand-in={path}", "--json")
    assert again.code == 0
    assert set().union(*states(again).values()) == {"ALREADY_APPLIED"}
    assert tree_digest(tree) == snapshot
    verified = cli("verify", recipe, "--rootfs", tree, "--source", f"stand-in={path}", "--json")
    assert verified.code == 0, verified.out


def test_dispatches_switch_between_native_and_original(cli, adapter: tuple[Path, str], tree: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path, commit = adapter
    assert cli("apply", write_recipe(tmp_path, commit, None), "--rootfs", tree,
               "--source", f"stand-in={path}").code == 0
    root = roots_of(tree)[1]
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.syspath_prepend(str(root / "vllm/model_executor/models"))
    for name in [m for m in sys.modules if m.split(".")[0] in ("qwen3_5", "native_fastpaths")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setenv("NATIVE_PROFILE", "1")
    monkeypatch.setenv("MOE_SMALL_BATCH_VARIANT", "segments")  # a fixed path, so its profile name is known
    adapter_mod = importlib.import_module("qwen3_5")
    profiling = importlib.import_module("native_fastpaths.profiling")
    assert adapter_mod.__file__.startswith(str(root))
    g = torch.Generator().manual_seed(0)
    block = adapter_mod.Qwen3_5MoeSparseBlock()
    x, logits = torch.randn(5, 16, generator=g), torch.randn(5, 8, generator=g)
    q, k = torch.randn(1, 70, 2, 8, generator=g), torch.randn(1, 70, 2, 8, generator=g)
    v = torch.randn(1, 70, 4, 12, generator=g)
    gate, beta = -torch.rand(1, 70, 4, generator=g), torch.rand(1, 70, 4, generator=g)
    norm = adapter_mod.Qwen3_5RMSNormGated(12)
    calls = {
        "MOE_NATIVE": (lambda: block._pure_pytorch_experts(x, logits), "moe.segments"),
        "CHUNK_PARALLEL": (lambda: adapter_mod._torch_chunk_gated_delta_rule(
            q, k, v, gate, beta, use_qk_l2norm_in_kernel=True)[0], "gdn.chunk"),
        "LOOP1_NATIVE": (lambda: adapter_mod._torch_recurrent_gated_delta_rule(
            q[:, :1], k[:, :1], v[:, :1], gate[:, :1], beta[:, :1], use_qk_l2norm_in_kernel=True)[0],
            "gdn.recurrent"),
        "RMSNORM_NATIVE": (lambda: norm(v, v * 2), "norm.gated"),
    }
    for switch, (call, profile_name) in calls.items():
        profiling._totals.clear()
        monkeypatch.setenv(switch, "0")
        original = call()
        off_paths = set(profiling._totals)
        monkeypatch.setenv(switch, "1")
        native = call()
        torch.testing.assert_close(native, original, atol=2e-4, rtol=2e-4)
        # with the switch on the injected path runs, with it off it does not
        assert profile_name in profiling._totals and profile_name not in off_paths, switch
    for name in [m for m in sys.modules if m.split(".")[0] in ("qwen3_5", "native_fastpaths")]:
        monkeypatch.delitem(sys.modules, name)


def test_missing_local_source_is_a_clear_error(cli, adapter: tuple[Path, str], tree: Path, tmp_path: Path) -> None:
    _, commit = adapter
    result = cli("apply", write_recipe(tmp_path, commit, None), "--rootfs", tree)
    assert result.code == 2
    assert "source 'stand-in' is not available here" in result.err and "--source stand-in=PATH" in result.err


def test_wrong_pin_is_refused(cli, adapter: tuple[Path, str], tree: Path, tmp_path: Path) -> None:
    path, _ = adapter
    result = cli("apply", write_recipe(tmp_path, "0" * 40, None), "--rootfs", tree, "--source", f"stand-in={path}")
    assert result.code == 2 and f"commit {'0' * 40} is not in" in result.err


def test_bundled_build_carries_the_pinned_adapter(cli, adapter: tuple[Path, str], corex_rootfs: Path,
                                                  tmp_path: Path) -> None:
    path, commit = adapter
    recipe = write_recipe(tmp_path, commit, os.path.relpath(path, tmp_path))  # sources[].path, recipe-relative
    out = tmp_path / "sub"
    result = cli("build", recipe, "-o", out, "--json")
    assert result.code == 0, result.err
    assert any(f"source stand-in: bundled at {commit}" in n for n in result.json()["notes"])
    assert result.json()["trial"]["untried"] == {}  # with the checkout, the adapter's edits are tried too
    bundled = out / "toolkit_payload/sources/stand-in/qwen3_5.py"
    assert bundled.read_text() == SOURCE
    assert cli("verify", out).code == 0
    proc = subprocess.run([sys.executable, "-m", "toolkit.inimage", str(out / "toolkit_payload/recipe/wired.yaml"),
                           "--rootfs", str(corex_rootfs)], capture_output=True, text=True, cwd=out,
                          env=dict(os.environ, PYTHONPATH=str(out / "toolkit_payload/src")))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[ok] moe-native /usr/local/corex/lib64/python3/dist-packages APPLIED" in proc.stdout


def test_fetch_mode_build_clones_and_verifies_the_pin(cli, adapter: tuple[Path, str], tmp_path: Path) -> None:
    _, commit = adapter
    out = tmp_path / "sub"
    result = cli("build", write_recipe(tmp_path, commit, None), "-o", out, "--json")
    assert result.code == 0, result.err
    assert any("NOT bundled" in n and "checks out " + commit in n for n in result.json()["notes"])
    # what needs the fetched adapter cannot be tried before writing: the report says so, by name
    untried = result.json()["trial"]["untried"]
    assert sorted(untried) == sorted(t["id"] for t in WIRING)
    assert any("not tried here, tried by the in-image step instead" in n for n in result.json()["notes"])
    script = (out / "toolkit_payload/apply.sh").read_text()
    assert "git clone --quiet --no-checkout https://adapter.invalid/qwen36_01.git" in script
    assert f'!= "{commit}"' in script
    assert not (out / "toolkit_payload/sources").exists()
    assert json.loads(cli("verify", out, "--json").out)["findings"] == []  # shellcheck and bash -n included
