"""The flagship recipe end to end on a CoreX-like tree built from the real vLLM 0.6.3.post1 wheel."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from conftest import FLAGSHIP, roots_of, tree_digest

from toolkit import engine as engine_mod
from toolkit.markers import read_markers
from toolkit.recipe import load_recipe

VENDOR_IDS = {t.id for t in load_recipe(FLAGSHIP).recipe.transforms}


def line_of(needle: str) -> int:
    return next(i + 1 for i, ln in enumerate(FLAGSHIP.read_text().splitlines()) if needle in ln)


def states(report: dict) -> dict[tuple[str, str], str]:  # type: ignore[type-arg]
    return {(r["transform"], r["root"]): r["state"] for r in report["results"]}


def test_apply_twice_then_verify(cli, corex_rootfs: Path) -> None:
    first = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, "--json")
    assert first.code == 0, first.out
    report = first.json()
    assert report["ok"] is True
    got = states(report)
    roots = load_recipe(FLAGSHIP).recipe.vendor.roots
    for tid in VENDOR_IDS:
        assert any(key[0] == tid for key in got), tid
    for (tid, root), state in got.items():
        assert state == "APPLIED", (tid, root)
    # every source transform ran in both roots
    for r in report["results"]:
        assert set(r) >= {"transform", "root", "file", "state", "message"}
    assert {root for (_, root) in got} == {*roots, "/"}

    snapshot = tree_digest(corex_rootfs)
    second = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, "--json")
    assert second.code == 0
    assert set(states(second.json()).values()) == {"ALREADY_APPLIED"}
    assert tree_digest(corex_rootfs) == snapshot, "a second apply must not change a byte"

    verified = cli("verify", FLAGSHIP, "--rootfs", corex_rootfs, "--json")
    assert verified.code == 0, verified.out
    assert verified.json()["ok"] is True
    assert verified.json()["findings"] == []


def test_patched_files_carry_markers_and_changes(cli, corex_rootfs: Path) -> None:
    assert cli("apply", FLAGSHIP, "--rootfs", corex_rootfs).code == 0
    for root in roots_of(corex_rootfs):
        arg_utils = (root / "vllm/engine/arg_utils.py").read_text()
        assert "enforce_eager=self.enforce_eager," in arg_utils
        assert "disable_custom_all_reduce=self.disable_custom_all_reduce," in arg_utils
        assert "enforce_eager=True" not in arg_utils
        assert set(read_markers(arg_utils)) == {"unhardcode-enforce-eager", "unhardcode-custom-all-reduce"}
        paged = (root / "vllm/attention/ops/paged_attn.py").read_text()
        assert "use_v1 = True" not in paged and "use_v1 = (max_seq_len <= 8192" in paged
        assert 'environ.get("PREFIX_FLASH", "1")' in paged
        assert "from native_fastpaths.prefix_attention import forward_prefix" in paged
        registry = (root / "vllm/model_executor/models/registry.py").read_text()
        qwen3_moe = registry.index('"Qwen3MoeForCausalLM"')
        assert qwen3_moe < registry.index('"Qwen3_5ForCausalLM": ("qwen3_5", "Qwen3_5ForCausalLM")')
        assert '"Qwen3_6MoeForCausalLM"' in registry
        protocol = (root / "vllm/entrypoints/openai/protocol.py").read_text()
        assert 'ConfigDict(extra="ignore")' in protocol
        xformers = (root / "vllm/attention/backends/xformers.py").read_text()
        assert "from native_fastpaths.attention import sdpa_varlen_prefill" in xformers
        assert (root / "native_fastpaths/attention.py").is_file()
        assert (root / ".toolkit/state.json").is_file()
    link = corex_rootfs / "usr/local/corex/lib64/libcusolver.so"
    assert os.readlink(link) == "libcusolver.so.11"
    assert (corex_rootfs / "opt/toolkit/chat_templates/qwen36_multi_system.jinja").is_file()


def test_stale_bytecode_is_removed(cli, corex_rootfs: Path) -> None:
    caches = []
    for root in roots_of(corex_rootfs):
        cache = root / "vllm/engine/__pycache__"
        cache.mkdir()
        (cache / "arg_utils.cpython-310.pyc").write_bytes(b"stale")
        (cache / "llm_engine.cpython-310.pyc").write_bytes(b"untouched module")
        caches.append(cache)
    assert cli("apply", FLAGSHIP, "--rootfs", corex_rootfs).code == 0
    for cache in caches:
        assert not (cache / "arg_utils.cpython-310.pyc").exists()
        assert (cache / "llm_engine.cpython-310.pyc").exists()


def test_verify_fails_on_a_pristine_tree(cli, corex_rootfs: Path) -> None:
    result = cli("verify", FLAGSHIP, "--rootfs", corex_rootfs, "--json")
    assert result.code == 1
    report = result.json()
    assert report["ok"] is False
    drifted = [r for r in report["results"] if r["state"] == "DRIFTED"]
    assert any("not applied" in r["message"] for r in drifted)


def test_verify_names_a_removed_marker(cli, corex_rootfs: Path) -> None:
    assert cli("apply", FLAGSHIP, "--rootfs", corex_rootfs).code == 0
    target = roots_of(corex_rootfs)[1] / "vllm/engine/arg_utils.py"
    text = target.read_text()
    target.write_text("\n".join(ln for ln in text.splitlines() if "unhardcode-enforce-eager" not in ln) + "\n")
    result = cli("verify", FLAGSHIP, "--rootfs", corex_rootfs, "--json")
    assert result.code == 1
    bad = [r for r in result.json()["results"] if r["state"] == "DRIFTED"]
    assert [(r["transform"], r["root"]) for r in bad] == [
        ("unhardcode-enforce-eager", "/usr/local/corex/lib64/python3/dist-packages")]
    assert "SUPERSEDED" not in {r["state"] for r in bad}


def test_verify_catches_crlf_in_deployed_files(cli, corex_rootfs: Path) -> None:
    assert cli("apply", FLAGSHIP, "--rootfs", corex_rootfs).code == 0
    deployed = roots_of(corex_rootfs)[0] / "native_fastpaths/__init__.py"
    deployed.write_bytes(deployed.read_bytes().replace(b"\n", b"\r\n"))
    result = cli("verify", FLAGSHIP, "--rootfs", corex_rootfs, "--json")
    assert result.code == 1
    checks = {(f["check"], f["file"]) for f in result.json()["findings"]}
    assert ("line-endings", "native_fastpaths/__init__.py") in checks


def test_drifted_vendor_file_changes_nothing(cli, corex_rootfs: Path) -> None:
    for root in roots_of(corex_rootfs):
        path = root / "vllm/engine/arg_utils.py"
        path.write_text(path.read_text().replace("enforce_eager=True,", "enforce_eager=bool(1),"))
    before = tree_digest(corex_rootfs)
    result = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, "--json")
    assert result.code == 1
    assert tree_digest(corex_rootfs) == before, "a DRIFTED run must leave every root byte-for-byte as it was"
    drifted = [r for r in result.json()["results"] if r["state"] == "DRIFTED"]
    assert {r["transform"] for r in drifted} == {"unhardcode-enforce-eager"}
    message = drifted[0]["message"]
    assert "enforce_eager=bool(1)" in message and "ModelConfig" in message and "arg_utils.py" in message
    assert drifted[0]["recipe_line"] == line_of("- id: unhardcode-enforce-eager")


@pytest.mark.parametrize("value", ["bool(1)", "not False"])
def test_a_changed_value_is_drift_not_superseded(cli, corex_rootfs: Path, value: str) -> None:
    # the vendor still forces V1, spelled differently: the image would build with V1 forced
    for root in roots_of(corex_rootfs):
        path = root / "vllm/attention/ops/paged_attn.py"
        text = path.read_text()
        assert text.count("use_v1 = True") == 1
        path.write_text(text.replace("use_v1 = True", f"use_v1 = {value}"))
    before = tree_digest(corex_rootfs)
    result = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, "--json")
    assert result.code == 1, result.out
    assert tree_digest(corex_rootfs) == before
    found = {r["root"]: r for r in result.json()["results"] if r["transform"] == "drop-forced-paged-attn-v1"}
    assert len(found) == 2 and {r["state"] for r in found.values()} == {"DRIFTED"}
    assert all(f"use_v1 = {value}" in r["message"] for r in found.values())


def test_upstream_heuristic_alone_is_superseded(cli, corex_rootfs: Path) -> None:
    for root in roots_of(corex_rootfs):
        path = root / "vllm/attention/ops/paged_attn.py"
        path.write_text(path.read_text().replace("use_v1 = True", "pass"))
    result = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, "--json")
    assert result.code == 0, result.out
    found = [r for r in result.json()["results"] if r["transform"] == "drop-forced-paged-attn-v1"]
    assert [r["state"] for r in found] == ["SUPERSEDED", "SUPERSEDED"]


def test_roots_that_differ_are_refused(cli, corex_rootfs: Path) -> None:
    lib64 = roots_of(corex_rootfs)[1] / "vllm/attention/ops/paged_attn.py"
    lib64.write_text(lib64.read_text() + "\n# hand edit in one root only\n")
    before = tree_digest(corex_rootfs)
    result = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs)
    assert result.code == 3
    assert "paged_attn.py differs between vendor roots" in result.err
    assert tree_digest(corex_rootfs) == before


def test_file_changed_after_apply_is_input_drift(cli, corex_rootfs: Path) -> None:
    assert cli("apply", FLAGSHIP, "--rootfs", corex_rootfs).code == 0
    for root in roots_of(corex_rootfs):
        path = root / "vllm/attention/ops/paged_attn.py"
        path.write_text(path.read_text() + "# edited later\n")
    result = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs)
    assert result.code == 3
    assert "changed since toolkit last applied" in result.err


def test_lock_detects_a_changed_base_image(cli, corex_rootfs: Path, tmp_path: Path) -> None:
    lock = tmp_path / "flagship.lock.json"
    pristine = tmp_path / "pristine"
    shutil.copytree(corex_rootfs, pristine, symlinks=True)
    assert cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, "--write-lock", lock).code == 0
    # the lock records the pristine hashes even when applied again on the patched tree
    assert cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, "--check-lock", lock).code == 0
    assert cli("apply", FLAGSHIP, "--rootfs", pristine, "--check-lock", lock, "--dry-run").code == 0
    for root in roots_of(pristine):
        path = root / "vllm/model_executor/models/registry.py"
        path.write_text(path.read_text() + "# a newer base image\n")
    before = tree_digest(pristine)
    result = cli("apply", FLAGSHIP, "--rootfs", pristine, "--check-lock", lock)
    assert result.code == 3
    assert "input drift against the lock" in result.err and "registry.py" in result.err
    assert tree_digest(pristine) == before


def test_wrong_vendor_version_is_refused(cli, corex_rootfs: Path) -> None:
    for root in roots_of(corex_rootfs):
        meta = next(root.glob("vllm-*.dist-info")) / "METADATA"
        meta.write_text(meta.read_text().replace("Version: 0.6.3+corex.3.2.3", "Version: 0.7.0"))
    result = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs)
    assert result.code == 3
    assert "does not satisfy vendor.version" in result.err and "bi100-qwen36.yaml:" in result.err


def test_a_failed_write_rolls_every_root_back(cli, corex_rootfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = tree_digest(corex_rootfs)
    real_place = engine_mod._place
    calls = {"n": 0}

    def failing_place(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 7:  # somewhere in the second root, after the first one was fully written
            raise OSError(28, "No space left on device")
        return real_place(*args, **kwargs)

    monkeypatch.setattr(engine_mod, "_place", failing_place)
    result = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs)
    assert result.code == 1
    assert "No space left on device" in result.err and "rolled back" in result.err
    assert calls["n"] > 7  # the rollback itself went through _place too
    assert tree_digest(corex_rootfs) == before


def test_diff_shows_each_transform_and_writes_nothing(cli, corex_rootfs: Path) -> None:
    before = tree_digest(corex_rootfs)
    result = cli("diff", FLAGSHIP, "--rootfs", corex_rootfs)
    assert result.code == 0
    assert "# transform unhardcode-enforce-eager" in result.out
    assert "-            enforce_eager=True," in result.out
    assert "+            enforce_eager=self.enforce_eager," in result.out
    assert '+    "Qwen3_5ForCausalLM": ("qwen3_5", "Qwen3_5ForCausalLM"),' in result.out
    stat = cli("diff", FLAGSHIP, "--rootfs", corex_rootfs, "--stat")
    assert stat.code == 0
    assert any(line.startswith("drop-forced-paged-attn-v1") and "+0 -1" in line for line in stat.out.splitlines())
    assert tree_digest(corex_rootfs) == before


def test_reference_063_reports_superseded_upstream(cli) -> None:
    """Upstream 0.6.3.post1 already passes self.enforce_eager: those patches are SUPERSEDED there."""
    result = cli("diff", FLAGSHIP, "--reference", "--json")
    got = {r["transform"]: r["state"] for r in result.json()["results"]}
    assert got["unhardcode-enforce-eager"] == "SUPERSEDED"
    assert got["unhardcode-custom-all-reduce"] == "SUPERSEDED"
    assert got["drop-forced-paged-attn-v1"] == "SUPERSEDED"
    assert got["openai-accept-unknown-fields"] == "APPLIED"
    # the vendor-only anchor is missing upstream, and the report says which key
    assert got["register-qwen3-5"] == "DRIFTED"
    assert got["chat-template-multi-system"] == "GATED_OFF"
    assert result.code == 1


def test_reference_085_reports_upstream_changes(cli, vllm_085: Path) -> None:
    result = cli("diff", FLAGSHIP, "--reference", "vllm==0.8.5.post1", "--json")
    report = result.json()
    got = {r["transform"]: r for r in report["results"]}
    assert got["unhardcode-enforce-eager"]["state"] == "SUPERSEDED"
    assert got["register-qwen3-5"]["state"] == "APPLIED"  # 0.8.5 has Qwen3MoeForCausalLM upstream
    openai = got["openai-accept-unknown-fields"]
    assert openai["state"] == "DRIFTED"
    assert 'extra="allow"' in openai["message"] and 'extra="forbid"' in openai["message"]
    assert openai["recipe_line"] == line_of("- id: openai-accept-unknown-fields")
