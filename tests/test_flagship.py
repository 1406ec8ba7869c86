"""The flagship recipe end to end on a CoreX-like tree built from the real vLLM 0.6.3 wheel."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pinned_adapter
import pytest
from conftest import FLAGSHIP, TRANSFORMERS_SITE, flagship_origin, roots_of, tree_digest
from pinned_adapter import add_commit

from toolkit.corexlike import COREX_ROOTS
from toolkit.engine import writer
from toolkit.markers import read_markers
from toolkit.recipe import load_recipe
from toolkit.transforms.deploy import Deploy

VENDOR_IDS = {t.id for t in load_recipe(FLAGSHIP).recipe.transforms}


def origin_of(result: dict) -> tuple[str, int]:  # type: ignore[type-arg]
    return result["recipe_file"], result["recipe_line"]


def states(report: dict) -> dict[tuple[str, str], str]:  # type: ignore[type-arg]
    return {(r["transform"], r["root"]): r["state"] for r in report["results"]}


def test_apply_twice_then_verify(cli, corex_rootfs: Path, flagship_args: list[str]) -> None:
    first = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args, "--json")
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
    site = flagship_args[flagship_args.index("--package-root") + 1].partition("=")[2]
    assert {root for (_, root) in got} == {*roots, "/", site}

    snapshot = tree_digest(corex_rootfs)
    second = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args, "--json")
    assert second.code == 0
    assert set(states(second.json()).values()) == {"ALREADY_APPLIED"}
    assert tree_digest(corex_rootfs) == snapshot, "a second apply must not change a byte"

    verified = cli("verify", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args, "--json")
    assert verified.code == 0, verified.out
    assert verified.json()["ok"] is True
    assert verified.json()["findings"] == []


def test_patched_files_carry_markers_and_changes(cli, corex_rootfs: Path, flagship_args: list[str]) -> None:
    assert cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args).code == 0
    for root in roots_of(corex_rootfs):
        arg_utils = (root / "vllm/engine/arg_utils.py").read_text()
        assert "enforce_eager=self.enforce_eager," in arg_utils
        assert "disable_custom_all_reduce=self.disable_custom_all_reduce," in arg_utils
        assert "enforce_eager=True" not in arg_utils
        assert set(read_markers(arg_utils)) == {"unhardcode-enforce-eager", "unhardcode-custom-all-reduce",
                                                "adapter-no-auto-chunked-prefill",
                                                "adapter-keep-prefix-caching-multimodal"}
        assert "Chunked prefill is enabled by default" not in arg_utils
        # the adapter's replacement, with the recipe's edits of it in the same write
        paged = (root / "vllm/attention/ops/paged_attn.py").read_text()
        assert "use_v1 = True" not in paged and "def _should_use_paged_attention_v1(" in paged
        # V1 stays: the vendor's build has no paged_attention_v2 (a rehearsal's decode over 512 tokens found it)
        assert "num_seqs * num_heads > 512" not in paged
        assert '__import__("native_fastpaths.switches", fromlist=["on"]).on("PREFIX_FLASH")' in paged
        assert "from native_fastpaths.prefix_attention import forward_prefix" in paged
        registry = (root / "vllm/model_executor/models/registry.py").read_text()
        qwen3_moe = registry.index('"Qwen3MoeForCausalLM"')
        assert qwen3_moe < registry.index('"Qwen3_5ForCausalLM": ("qwen3_5", "Qwen3_5ForCausalLM")')
        assert '"Qwen3_6MoeForCausalLM": ("qwen3_5", "Qwen3_5MoeForCausalLM")' in registry
        protocol_bytes = (root / "vllm/entrypoints/openai/protocol.py").read_bytes()
        assert b"\r" not in protocol_bytes, "the adapter stores it CRLF; it is deployed LF"
        pinned = pinned_adapter.source_file("protocol.py").replace(b"\r\n", b"\n")
        assert b'ConfigDict(extra="ignore")' in protocol_bytes and protocol_bytes.startswith(pinned[:600])
        assert '"--reasoning-parser"' in (root / "vllm/entrypoints/openai/cli_args.py").read_text()
        model = (root / "vllm/model_executor/models/qwen3_5.py").read_text()
        assert {"moe-native", "gdn-chunk-parallel", "rmsnorm-native"} <= set(read_markers(model))
        assert (root / "vllm/reasoning/qwen3_reasoning_parser.py").is_file() and (root / "vllm/bi100_env.py").is_file()
        parsers = (root / "vllm/entrypoints/openai/tool_parsers/__init__.py").read_text()
        assert "from .qwen3coder_tool_parser import Qwen3CoderToolParser" in parsers
        runner = (root / "vllm/worker/model_runner.py").read_text()
        assert "inter_data.prefix_cache_hit = False" in runner
        worker = (root / "vllm/worker/worker.py").read_text()
        assert "skipping worker.profile_run" in worker
        xformers = (root / "vllm/attention/backends/xformers.py").read_text()
        assert "from native_fastpaths.attention import sdpa_varlen_prefill" in xformers
        assert (root / "native_fastpaths/attention.py").is_file()
        assert (root / ".toolkit/state.json").is_file()
    link = corex_rootfs / "usr/local/corex/lib64/libcusolver.so"
    assert os.readlink(link) == "libcusolver.so.11"
    assert (corex_rootfs / "opt/toolkit/chat_templates/qwen36_multi_system.jinja").is_file()
    site = corex_rootfs / TRANSFORMERS_SITE / "transformers"
    assert '("qwen3_5_moe", "Qwen3_5MoeConfig")' in (site / "models/auto/configuration_auto.py").read_text()
    assert (site / "models/qwen3_5_moe/configuration_qwen3_5_moe.py").is_file()
    assert "from .qwen3_5_moe import *" in (site / "models/__init__.py").read_text()


def test_stale_bytecode_is_removed(cli, corex_rootfs: Path, flagship_args: list[str]) -> None:
    caches = []
    for root in roots_of(corex_rootfs):
        cache = root / "vllm/engine/__pycache__"
        cache.mkdir()
        (cache / "arg_utils.cpython-310.pyc").write_bytes(b"stale")
        (cache / "llm_engine.cpython-310.pyc").write_bytes(b"untouched module")
        caches.append(cache)
    assert cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args).code == 0
    for cache in caches:
        assert not (cache / "arg_utils.cpython-310.pyc").exists()
        assert (cache / "llm_engine.cpython-310.pyc").exists()


def test_verify_fails_on_a_pristine_tree(cli, corex_rootfs: Path, flagship_args: list[str]) -> None:
    result = cli("verify", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args, "--json")
    assert result.code == 1
    report = result.json()
    assert report["ok"] is False
    drifted = [r for r in report["results"] if r["state"] == "DRIFTED"]
    assert any("not applied" in r["message"] for r in drifted)


def test_verify_names_a_removed_marker(cli, corex_rootfs: Path, flagship_args: list[str]) -> None:
    assert cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args).code == 0
    target = roots_of(corex_rootfs)[1] / "vllm/engine/arg_utils.py"
    text = target.read_text()
    target.write_text("\n".join(ln for ln in text.splitlines() if "unhardcode-enforce-eager" not in ln) + "\n")
    result = cli("verify", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args, "--json")
    assert result.code == 1
    bad = [r for r in result.json()["results"] if r["state"] == "DRIFTED"]
    assert [(r["transform"], r["root"]) for r in bad] == [
        ("unhardcode-enforce-eager", "/usr/local/corex/lib64/python3/dist-packages")]
    assert "SUPERSEDED" not in {r["state"] for r in bad}


def test_verify_names_a_deployed_file_changed_after_apply(cli, corex_rootfs: Path, flagship_args: list[str]) -> None:
    """Every marker and post-state stays in place: only the digest apply recorded of its result sees the edit."""
    assert cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args).code == 0
    root = roots_of(corex_rootfs)[0]
    model = root / "vllm/model_executor/models/qwen3_5.py"
    text = model.read_text()
    edited = text.replace('env_int("BI100_DNN_CHUNK", 4096,', 'env_int("BI100_DNN_CHUNK", 2048,')
    assert edited != text, "the adapter's module-level chunk constant"
    model.write_text(edited)
    result = cli("verify", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args, "--json")
    assert result.code == 1, result.out
    report = result.json()
    assert report["ok"] is False
    assert {r["state"] for r in report["results"]} <= {"ALREADY_APPLIED", "GATED_OFF"}, "every marker in place"
    changed = [f for f in report["findings"] if f["check"] == "changed-after-apply"]
    assert [(f["root"], f["file"]) for f in changed] == [(COREX_ROOTS[0], "vllm/model_executor/models/qwen3_5.py")]
    assert ".toolkit/state.json" in changed[0]["message"] and "rebuild the tree" in changed[0]["message"]


def test_verify_catches_crlf_in_deployed_files(cli, corex_rootfs: Path, flagship_args: list[str]) -> None:
    assert cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args).code == 0
    deployed = roots_of(corex_rootfs)[0] / "native_fastpaths/__init__.py"
    deployed.write_bytes(deployed.read_bytes().replace(b"\n", b"\r\n"))
    result = cli("verify", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args, "--json")
    assert result.code == 1
    checks = {(f["check"], f["file"]) for f in result.json()["findings"]}
    assert ("line-endings", "native_fastpaths/__init__.py") in checks


def test_drifted_vendor_file_changes_nothing(cli, corex_rootfs: Path, flagship_args: list[str]) -> None:
    for root in roots_of(corex_rootfs):
        path = root / "vllm/engine/arg_utils.py"
        path.write_text(path.read_text().replace("enforce_eager=True,", "enforce_eager=bool(1),"))
    before = tree_digest(corex_rootfs)
    result = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args, "--json")
    assert result.code == 1
    assert tree_digest(corex_rootfs) == before, "a DRIFTED run must leave every root byte-for-byte as it was"
    drifted = [r for r in result.json()["results"] if r["state"] == "DRIFTED"]
    assert {r["transform"] for r in drifted} == {"unhardcode-enforce-eager"}
    message = drifted[0]["message"]
    assert "enforce_eager=bool(1)" in message and "ModelConfig" in message and "arg_utils.py" in message
    assert origin_of(drifted[0]) == flagship_origin("old:", after="- id: unhardcode-enforce-eager")


def test_a_replaced_vendor_file_that_changed_is_drift(cli, corex_rootfs: Path, flagship_args: list[str]) -> None:
    # a newer base image changed a file the adapter replaces: replacing it would silently drop the change
    for root in roots_of(corex_rootfs):
        path = root / "vllm/attention/ops/paged_attn.py"
        path.write_text(path.read_text() + "\n# the vendor fixed something here\n")
    before = tree_digest(corex_rootfs)
    result = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args, "--json")
    assert result.code == 1, result.out
    assert tree_digest(corex_rootfs) == before, "nothing is written"
    found = [r for r in result.json()["results"] if r["transform"] == "adapter-replace-paged-attn"]
    assert [r["state"] for r in found] == ["DRIFTED", "DRIFTED"]
    assert all("the vendor file changed" in r["message"] and "toolkit diff" in r["message"] for r in found)
    assert origin_of(found[0]) == flagship_origin("- id: adapter-replace-paged-attn")


def test_the_real_image_expectations_are_checked(cli, corex_rootfs: Path, flagship_args: list[str],
                                                 tmp_path: Path) -> None:
    """The flagship expects the real image's nine files, and the fixture carries them; an --expect lock naming
    other digests (a tree that is not the image) is what the replacements are then held to."""
    result = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args, "--dry-run", "--json")
    assert result.code == 0, result.out
    states = {r["state"] for r in result.json()["results"] if r["transform"].startswith("adapter-replace-")}
    assert states == {"WOULD_APPLY"}
    recipe = load_recipe(FLAGSHIP).recipe
    lock = {t.dest: t.replaces for t in recipe.transforms if isinstance(t, Deploy) and t.replaces}
    lock["vllm/sequence.py"] = "0" * 64
    (tmp_path / "lock.json").write_text(json.dumps(lock))
    before = tree_digest(corex_rootfs)
    result = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args, "--expect", tmp_path / "lock.json",
                 "--json")
    assert result.code == 1 and tree_digest(corex_rootfs) == before
    drifted = {r["transform"] for r in result.json()["results"] if r["state"] == "DRIFTED"}
    assert drifted == {"adapter-replace-sequence"}


def test_an_edit_the_replacement_already_makes_is_superseded(cli, corex_rootfs: Path, flagship_args: list[str],
                                                            adapter: tuple[Path, str]) -> None:
    clone, _ = adapter
    text = pinned_adapter.source_file("protocol.py")
    assert text.count(b'extra="forbid"') == 1
    later = add_commit(clone, "protocol.py", text.replace(b'extra="forbid"', b'extra="ignore"'),
                       "protocol accepts unknown fields")
    args = [a if not a.startswith("qwen36-adapter=") else f"qwen36-adapter={clone}@{later}" for a in flagship_args]
    result = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *args, "--json")
    assert result.code == 0, result.out
    got = {r["transform"]: r["state"] for r in result.json()["results"]}
    assert got["openai-accept-unknown-fields"] == "SUPERSEDED" and got["adapter-replace-protocol"] == "APPLIED"
    assert f"overridden by --source for this run: {later}" in result.err


def test_roots_that_differ_are_refused(cli, corex_rootfs: Path, flagship_args: list[str]) -> None:
    lib64 = roots_of(corex_rootfs)[1] / "vllm/attention/ops/paged_attn.py"
    lib64.write_text(lib64.read_text() + "\n# hand edit in one root only\n")
    before = tree_digest(corex_rootfs)
    result = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args)
    assert result.code == 3
    assert "paged_attn.py differs between vendor roots" in result.err
    assert tree_digest(corex_rootfs) == before


def test_file_changed_after_apply_is_input_drift(cli, corex_rootfs: Path, flagship_args: list[str]) -> None:
    assert cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args).code == 0
    for root in roots_of(corex_rootfs):
        path = root / "vllm/attention/ops/paged_attn.py"
        path.write_text(path.read_text() + "# edited later\n")
    result = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args)
    assert result.code == 3
    assert "changed since toolkit last applied" in result.err


def test_lock_detects_a_changed_base_image(cli, corex_rootfs: Path, tmp_path: Path, flagship_args: list[str]) -> None:
    lock = tmp_path / "flagship.lock.json"
    pristine = tmp_path / "pristine"
    shutil.copytree(corex_rootfs, pristine, symlinks=True)
    assert cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args, "--write-lock", lock).code == 0
    # the lock records the pristine hashes even when applied again on the patched tree
    assert cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args, "--check-lock", lock).code == 0
    assert cli("apply", FLAGSHIP, "--rootfs", pristine, *flagship_args, "--check-lock", lock, "--dry-run").code == 0
    for root in roots_of(pristine):
        path = root / "vllm/model_executor/models/registry.py"
        path.write_text(path.read_text() + "# a newer base image\n")
    before = tree_digest(pristine)
    result = cli("apply", FLAGSHIP, "--rootfs", pristine, *flagship_args, "--check-lock", lock)
    assert result.code == 3
    assert "input drift against the lock" in result.err and "registry.py" in result.err
    assert tree_digest(pristine) == before


def test_wrong_vendor_version_is_refused(cli, corex_rootfs: Path, flagship_args: list[str]) -> None:
    for root in roots_of(corex_rootfs):
        meta = next(root.glob("vllm-*.dist-info")) / "METADATA"
        meta.write_text(meta.read_text().replace("Version: 0.6.3+corex.3.2.3", "Version: 0.7.0"))
    result = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args)
    assert result.code == 3
    layer, at = flagship_origin('version: ">=0.6.3')
    assert "does not satisfy vendor.version" in result.err and f"{layer}:{at}" in result.err  # the image layer's


def test_a_failed_write_rolls_every_root_back(cli, corex_rootfs: Path, monkeypatch: pytest.MonkeyPatch,
                                              flagship_args: list[str]) -> None:
    before = tree_digest(corex_rootfs)
    real_place = writer._place
    first, second = (str(r) for r in roots_of(corex_rootfs))
    placed: list[str] = []
    failed: list[str] = []

    def failing_place(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not failed and str(path).startswith(second) and any(p.startswith(first) for p in placed):
            failed.append(str(path))
            raise OSError(28, "No space left on device")  # in the second root, with the first one written to
        placed.append(str(path))
        return real_place(path, *args, **kwargs)

    monkeypatch.setattr(writer, "_place", failing_place)
    result = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args)
    assert result.code == 1
    assert "No space left on device" in result.err and "rolled back" in result.err
    assert any(p.startswith(first) for p in placed), "the failure came after writes that had to be rolled back"
    assert tree_digest(corex_rootfs) == before


def test_diff_shows_each_transform_and_writes_nothing(cli, corex_rootfs: Path, flagship_args: list[str]) -> None:
    before = tree_digest(corex_rootfs)
    result = cli("diff", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args)
    assert result.code == 0
    assert "# transform unhardcode-enforce-eager" in result.out
    assert "-            enforce_eager=True," in result.out
    assert "+            enforce_eager=self.enforce_eager," in result.out
    assert '+    "Qwen3_5ForCausalLM": ("qwen3_5", "Qwen3_5ForCausalLM"),' in result.out
    stat = cli("diff", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args, "--stat")
    assert stat.code == 0
    assert any(line.startswith("adapter-replace-paged-attn") for line in stat.out.splitlines())
    # a replacement is shown against the vendor file it replaces
    assert "# transform adapter-replace-paged-attn" in result.out
    assert "-        use_v1 = True" in result.out and "+    def _should_use_paged_attention_v1(" in result.out
    assert tree_digest(corex_rootfs) == before


def test_reference_063_reports_superseded_upstream(cli, adapter_args: list[str]) -> None:
    """Upstream 0.6.3.post1 already passes self.enforce_eager: those patches are SUPERSEDED there."""
    result = cli("diff", FLAGSHIP, "--reference", *adapter_args, "--json")
    got = {r["transform"]: r["state"] for r in result.json()["results"]}
    assert got["unhardcode-enforce-eager"] == "SUPERSEDED"
    assert got["unhardcode-custom-all-reduce"] == "SUPERSEDED"
    assert got["openai-accept-unknown-fields"] == "WOULD_APPLY"
    # the vendor-only anchor is missing upstream, and the report says which key
    assert got["register-qwen3-5"] == "DRIFTED"
    assert got["chat-template-multi-system"] == "GATED_OFF"
    assert result.code == 1


def test_reference_085_reports_upstream_changes(cli, vllm_085: Path, adapter_args: list[str]) -> None:
    result = cli("diff", FLAGSHIP, "--reference", "vllm==0.8.5.post1", *adapter_args, "--json")
    report = result.json()
    got = {r["transform"]: r for r in report["results"]}
    assert got["unhardcode-enforce-eager"]["state"] == "SUPERSEDED"
    assert got["register-qwen3-5"]["state"] == "WOULD_APPLY"  # 0.8.5 has Qwen3MoeForCausalLM upstream
    # 0.8.5's protocol.py is not the file the adapter's replacement was made from: the contract says so
    replaced = got["adapter-replace-protocol"]
    assert replaced["state"] == "DRIFTED" and "the vendor file changed" in replaced["message"]
    assert origin_of(replaced) == flagship_origin("- id: adapter-replace-protocol")
    # the edit of the replacement still lands on the replacement's own content
    assert got["openai-accept-unknown-fields"]["state"] == "WOULD_APPLY"


def test_a_replaced_vendor_file_that_is_gone_is_drift(cli, corex_rootfs: Path, flagship_args: list[str]) -> None:
    for root in roots_of(corex_rootfs):
        (root / "vllm/entrypoints/openai/protocol.py").unlink()
    before = tree_digest(corex_rootfs)
    result = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args, "--json")
    assert result.code == 1 and tree_digest(corex_rootfs) == before
    found = [r for r in result.json()["results"] if r["transform"] == "adapter-replace-protocol"]
    assert [r["state"] for r in found] == ["DRIFTED", "DRIFTED"]
    assert all("the vendor file this deploy replaces is missing" in r["message"] for r in found)


def test_the_restore_anchor_without_the_pins_timer_is_drifted_by_id(cli, corex_rootfs: Path, flagship_args: list[str],
                                                                     tmp_path: Path) -> None:
    """At the pin the restore's two copy_ calls sit inside `with bi100_timer("gdn_prefix.restore"):`; the anchor as
    it was written before (taken from another copy of qwen3_5.py) drifts on the pinned files, named by its id, and
    nothing is written."""
    from test_preflight import recipe_copy

    def unwrapped(data: dict[str, Any]) -> None:
        spec = next(t for t in data["transforms"] if t["id"] == "prefix-state-no-block-id-restore")
        lines = spec["old"].splitlines(keepends=True)
        [at] = [i for i, line in enumerate(lines) if line.strip() == 'with bi100_timer("gdn_prefix.restore"):']
        # the timer's line out, its four lines (the two copy_ calls) one level up
        spec["old"] = "".join(lines[:at] + [line[4:] for line in lines[at + 1:at + 5]] + lines[at + 5:])

    recipe = recipe_copy(tmp_path / "recipe", unwrapped)
    before = tree_digest(corex_rootfs)
    result = cli("apply", recipe, "--rootfs", corex_rootfs, *flagship_args, "--json")
    assert result.code == 1, result.out[-2000:]
    drifted = {r["transform"] for r in result.json()["results"] if r["state"] == "DRIFTED"}
    assert drifted == {"prefix-state-no-block-id-restore"}, drifted
    assert tree_digest(corex_rootfs) == before
