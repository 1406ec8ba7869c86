"""`toolkit preflight` and the patches at run time: the patched vLLM 0.6.3's own Python on the CPU runtime.

The runtime (torch's CPU build and vLLM's pure-Python dependencies, never vLLM itself) is built once in
~/.cache/vllm-toolkit/cpu-runtime, about a minute; the patched tree is what it imports.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import FLAGSHIP, REPO, flagship_data, roots_of, transformers_site, tree_digest

from toolkit.recipe import load_recipe
from toolkit.runtime import standins, tiny_model
from toolkit.runtime.env import runtime
from toolkit.runtime.preflight import emulated_devices

VENDOR_MESSAGE = "max_num_batched_tokens (8192) is smaller than max_model_len (262144)"


@pytest.fixture(scope="session")
def python() -> Path:
    return runtime()


def recipe_copy(tmp_path: Path, edit: Any) -> Path:
    data = flagship_data()
    data["patches"] = str(REPO / "patches/src")
    edit(data)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "bi100-qwen36.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def runtime_env(tmp_path: Path, *paths: Path, cpu_device: bool = False) -> dict[str, str]:
    """The environment a script runs in on the CPU runtime: the patched tree first, the flagship's GPU libraries
    stood in and its devices emulated (as preflight does), and a record of what was stood in and called written at
    exit. cpu_device: the vendor's GPU path on CPU tensors too, as the rehearsal runs it (the adapter's
    MambaCacheManager allocates its state on "cuda")."""
    recipe = load_recipe(FLAGSHIP).recipe
    return dict(os.environ, **standins.environment(tmp_path / "standins", recipe.base_image.gpu_library_names, paths,
                                                   recipe.base_image.absent_modules, emulated_devices(recipe),
                                                   cpu_device=cpu_device),
                TOOLKIT_GPU_STANDINS_RECORD=str(tmp_path / "standins.json"),
                # the harnesses' configs take the tiny tower (runtime_shims.vision_config): the adapter's default
                # one would be most of each model's start
                HARNESS_VISION_CONFIG=json.dumps(tiny_model.vision_config("qwen3_5_moe", 0)))


def run_on_patched_tree(cli: Any, python: Path, rootfs: Path, flagship_args: list[str], script: str,
                        tmp_path: Path) -> tuple[Any, dict[str, Any]]:
    """Apply the flagship, then run a tests/ script in the runtime with the patched root first: its JSON, and the
    stand-ins' record."""
    assert cli("apply", FLAGSHIP, "--rootfs", rootfs, *flagship_args).code == 0
    env = runtime_env(tmp_path, roots_of(rootfs)[1])
    proc = subprocess.run([str(python), str(REPO / "tests" / script)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), standins.read_record(tmp_path / "standins.json")


def by_variant(result: Any) -> dict[str, dict[str, Any]]:
    return {v["variant"]: v for v in result.json()["variants"]}


def stages(variant: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["stage"]: s for s in variant["stages"]}


def test_every_flagship_variant_through_the_vendor_code(cli, python: Path, adapter: tuple[Path, str]) -> None:
    clone, commit = adapter
    result = cli("preflight", FLAGSHIP, "--all-variants", "--source", f"qwen36-adapter={clone}@{commit}", "--json")
    assert result.code == 2, result.err[-2000:]  # the variants without chunked prefill cannot start
    variants = by_variant(result)
    assert len(variants) == 38
    base = stages(variants["base"])
    assert all(s["ok"] for s in base.values()), base
    assert base["architecture"]["message"].endswith("vllm.model_executor.models.qwen3_5.Qwen3_5MoeForCausalLM")
    assert base["tool-parser"]["ok"] and base["reasoning-parser"]["ok"]
    assert base["prefix-state"]["message"] == "the 7 prefix-state hooks are in the patched tree"
    assert variants["base"]["config"]["enforce_eager"] is True  # the flag is passed, and it now counts
    refused = {name for name, v in variants.items() if not v["starts"]}
    assert refused == {name for name in variants if "ecp-false" in name}
    failure = stages(variants["mnbt-8192_mns-1_ecp-false_hka-full-attention"])["engine-config"]
    assert failure["type"] == "ValueError" and VENDOR_MESSAGE in failure["message"]
    assert failure["where"].startswith("vllm/config.py:")
    # lint drops the same variants: nothing either one misses
    notes = result.json()["notes"]
    assert not any("lint missed" in n for n in notes)
    # what lint drops that the config code cannot see: every layer's KV beside six images' start profile is sized
    # when the engine starts (the rehearsal's legacy40 test sees the vendor refuse it there)
    unreproduced = {n.split(":")[0]: n for n in notes if "not reproduced" in n}
    assert set(unreproduced) == {n for n in variants if n.endswith("hka-legacy40") and "ecp-false" not in n}
    assert all("lint error not reproduced by the vendor's code (a GPU-only failure, or a lint rule to revisit): "
               "kv-cache: the KV cache cannot hold one 262144-token sequence" in n for n in unreproduced.values())
    # the vendor's own KV block size from the adapter's patched config classes, under each accounting, and lint's
    # estimate agrees with it: 10 full-attention layers counted by default, all 40 with legacy40
    kv = variants["base"]["kv"]
    accountings = kv.pop("accountings")
    assert kv == {"block_bytes": 163840, "block_size": 16, "bytes_per_token": 10240, "attention_layers": 10,
                  "layers": 40, "switch": "HYBRID_KV_ACCOUNTING"}
    assert {k: (a["attention_layers"], a["block_bytes"]) for k, a in accountings.items()} == {
        "full_attention": (10, 163840), "legacy40": (40, 655360)}
    legacy = variants["kv-legacy40"]["kv"]
    assert (legacy["attention_layers"], legacy["block_bytes"]) == (40, 655360)
    said = next(n for n in notes if n.startswith("base: KV:"))
    assert "10240 B/token/card, agrees with lint" in said
    per_card = float(said.split(" sequence(s) of 262144 tokens fit per card")[0].rsplit(" ", 1)[1])
    assert per_card >= 3, said  # beside the start's six-image profile (lint: 3.7)
    assert "legacy40: 40 layers, 655360 B per block" in said


def test_without_the_adapter_preflight_refuses_instead_of_checking_another_tree(cli, python: Path) -> None:
    # (tests/test_complete_tree.py has each verb's refusal; build's own preflight still runs what it can, below)
    result = cli("preflight", FLAGSHIP, "--json")
    assert result.code == 2, result.err[-2000:]
    assert "preflight: the tree would not be the submission's" in result.json()["error"]
    assert "--source qwen36-adapter=PATH" in result.json()["fix"]


def test_unhardcoded_flags_count_and_the_vendor_forces_them(cli, python: Path, adapter: tuple[Path, str],
                                                           tmp_path: Path) -> None:
    clone, commit = adapter
    source = ["--source", f"qwen36-adapter={clone}@{commit}", "--json"]

    def without_flags(data: dict[str, Any]) -> None:
        data["serve"]["args"].pop("enforce-eager")
        data["serve"]["args"]["disable-custom-all-reduce"] = False
        data["variants"] = {"with-flags": {"args": {"enforce-eager": True, "disable-custom-all-reduce": True}}}
        data.pop("matrix")
        data["checks"].pop("fast_paths_off")  # it names a variant this copy drops

    patched = by_variant(cli("preflight", recipe_copy(tmp_path / "a", without_flags), "--all-variants", *source))
    config = patched["base"]["config"]
    assert config["enforce_eager"] is False and config["disable_custom_all_reduce"] is False
    flagged = patched["with-flags"]["config"]
    assert flagged["enforce_eager"] is True and flagged["disable_custom_all_reduce"] is True

    def vendor_as_is(data: dict[str, Any]) -> None:
        without_flags(data)
        data["transforms"] = [t for t in data["transforms"] if not t["id"].startswith("unhardcode-")]

    forced = by_variant(cli("preflight", recipe_copy(tmp_path / "b", vendor_as_is), *source))["base"]["config"]
    assert forced["enforce_eager"] is True and forced["disable_custom_all_reduce"] is True


def test_the_vendor_refuses_an_unknown_flag_and_parser(cli, python: Path, adapter: tuple[Path, str],
                                                      tmp_path: Path) -> None:
    clone, commit = adapter

    def bad(data: dict[str, Any]) -> None:
        data["serve"]["args"]["num-scheduler-stepz"] = 8
        data["variants"] = {"other-parser": {"args": {"num-scheduler-stepz": None, "tool-call-parser": "qwen4"}},
                            # no image a prompt: lint's start profile of images (mm-profile) would refuse it first
                            "tiny-batch": {"args": {"num-scheduler-stepz": None, "max-num-batched-tokens": 2,
                                                    "max-num-seqs": 4, "limit-mm-per-prompt": "image=0"}}}
        data.pop("matrix")
        data["checks"].pop("fast_paths_off")  # it names a variant this copy drops

    result = cli("preflight", recipe_copy(tmp_path, bad), "--all-variants", "--source",
                 f"qwen36-adapter={clone}@{commit}", "--json")
    assert result.code == 2
    variants = by_variant(result)
    parse = stages(variants["base"])["parse"]
    assert not parse["ok"] and "unrecognized arguments: --num-scheduler-stepz 8" in parse["message"]
    parser = stages(variants["other-parser"])["tool-parser"]
    assert not parser["ok"] and "invalid tool call parser: qwen4" in parser["message"]
    # lint refuses those two as well; this one only the vendor's scheduler config does
    tiny = stages(variants["tiny-batch"])["engine-config"]
    assert not tiny["ok"] and "max_num_batched_tokens (2) must be greater than or equal to max_num_seqs (4)" \
        in tiny["message"]
    notes = result.json()["notes"]
    assert any(n.startswith("tiny-batch: the vendor's code refuses what lint missed: engine-config") for n in notes)
    assert not any(n.startswith(("base: the vendor", "other-parser: the vendor")) for n in notes)


def test_openai_requests_accept_unknown_fields_only_when_patched(cli, python: Path, corex_rootfs: Path,
                                                               flagship_args: list[str], tmp_path: Path) -> None:
    """The patched ChatCompletionRequest accepts a newer client's fields; the vendor's rejects them."""
    code = ("import json, sys\nfrom vllm.entrypoints.openai.protocol import ChatCompletionRequest\n"
            "body = {'model': 'llm', 'messages': [{'role': 'user', 'content': 'hi'}], 'reasoning_effort': 'low'}\n"
            "try:\n    ChatCompletionRequest(**body)\n    print('accepted')\n"
            "except Exception as exc:\n    print('rejected', type(exc).__name__)\n")
    version = "import importlib.metadata as m; r = m.version; m.version = lambda n: r(n) + '+cpu' " \
              "if n == 'vllm' else r(n)\n"

    def run(root: Path) -> str:
        env = runtime_env(tmp_path, root)
        proc = subprocess.run([str(python), "-c", version + code], capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.strip().splitlines()[-1]

    vendor = run(roots_of(corex_rootfs)[0])
    assert cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args).code == 0
    assert vendor == "rejected ValidationError"
    assert run(roots_of(corex_rootfs)[0]) == "accepted"


def test_build_refuses_what_the_vendor_code_refuses(cli, python: Path, tmp_path: Path) -> None:
    # lint has no rule for this one; the vendor's scheduler config refuses it at start
    # (no image a prompt: lint's start profile of images, mm-profile, would refuse it first)
    recipe = recipe_copy(tmp_path / "r", lambda d: d["serve"]["args"].update({"max-num-batched-tokens": 2,
                                                                            "max-num-seqs": 4,
                                                                            "limit-mm-per-prompt": "image=0"}))
    out = tmp_path / "sub"
    result = cli("build", recipe, "-o", out, "--json")
    assert result.code == 2 and not out.exists()
    report = result.json()
    assert report["verb"] == "build" and "nothing was written" in report["notes"]
    assert any("must be greater than or equal to max_num_seqs" in f["message"] for f in report["findings"])
    again = cli("build", recipe_copy(tmp_path / "ok", lambda d: None), "-o", out, "--json")
    said = [n for n in again.json()["notes"] if n.startswith("preflight: 1 variant(s) start")]
    assert again.code == 0 and len(said) == 1
    # fetch mode: what the adapter adds was not checked, and the build says so instead of claiming it
    assert "not checked here, left to the in-image step: " in said[0], said[0]
    left = said[0].split("not checked here, left to the in-image step: ", 1)[1]
    assert "--reasoning-parser (added by source qwen36-adapter" in left, left
    # vLLM takes an image limit only for the multimodal model the adapter registers
    assert "--limit-mm-per-prompt (taken for the multimodal model source qwen36-adapter registers" in left, left


def test_the_accelerator_count_is_the_recipes(cli, python: Path, adapter: tuple[Path, str], tmp_path: Path) -> None:
    clone, commit = adapter
    recipe = recipe_copy(tmp_path, lambda d: d["hardware"].update(count=2))  # TP 4 on two cards
    result = cli("preflight", recipe, "--source", f"qwen36-adapter={clone}@{commit}", "--json")
    assert result.code == 2
    failed = [s for s in by_variant(result)["base"]["stages"] if not s["ok"]]
    assert failed and failed[0]["stage"] == "engine-config", failed


def test_a_served_flag_the_vendors_config_turns_off_silently_fails_preflight(cli, python: Path,
                                                                             adapter: tuple[Path, str],
                                                                             tmp_path: Path) -> None:
    """vLLM 0.6.3 turns --enable-prefix-caching off, with a warning only, for any model it sees as multimodal, which
    the adapter's model is since 2f7d5f5 (a vision tower). Without the flagship's transform that keeps it on, the
    server would start and serve without the cache the recipe is built around; preflight says so, by flag."""
    clone, commit = adapter
    recipe = recipe_copy(tmp_path, lambda d: d.__setitem__(
        "transforms", [t for t in d["transforms"] if t["id"] != "adapter-keep-prefix-caching-multimodal"]))
    result = cli("preflight", recipe, "--source", f"qwen36-adapter={clone}@{commit}", "--json")
    assert result.code == 2, result.out[-2000:] + result.err[-2000:]
    failed = [s for s in by_variant(result)["base"]["stages"] if not s["ok"]]
    assert failed and failed[0]["stage"] == "served-flags", failed
    assert "turns on --enable-prefix-caching" in failed[0]["message"], failed


# each prior-art launch that died at start: the vendor code's verdict, or why only a GPU (or lint) can tell
PRIOR_ART = {
    "prior-no-chunked-prefill": ("engine-config", "max_num_batched_tokens (8192) is smaller than max_model_len"),
    "prior-flashinfer": ("attention-backend", "vLLM selects FLASHINFER (VLLM_ATTENTION_BACKEND=FLASHINFER), which "
                         "the image cannot load"),
    "prior-multi-step-xformers": ("multi-step", "Multi-Step not supported for attention backend: xformers"),
    "prior-multi-step-chunked": ("multi-step", "Multi-Step + Chunked-Prefill not supported for attention backend"),
    "prior-cuda-graphs": (None, "GPU only: CUDA graph capture hangs on the device; the config is valid"),
    "prior-kv-oom": (None, "GPU only: the KV cache is sized from the profiled free memory on the device"),
    "prior-short-context": (None, "not a start failure: the server starts, the workload's prompts do not fit"),
    "prior-workdir-shadow": (None, "the image's import order, not vLLM's code: lint and the in-image step see it"),
}


@pytest.mark.parametrize("name", sorted(PRIOR_ART))
def test_prior_art_in_the_vendor_code(cli, python: Path, name: str) -> None:
    stage, text = PRIOR_ART[name]
    result = cli("preflight", REPO / "tests/recipes" / f"{name}.yaml", "--json")
    variant = by_variant(result)["base"]
    failed = [s for s in variant["stages"] if not s["ok"]]
    if name == "prior-short-context":
        # only the platform's workload needs the longer context: preflight runs it and says it is no submission
        assert variant["lint_errors"] == [] and variant["not_a_submission"][0].startswith("context-length: ")
        said = "base: preflighted, but not a submission: context-length: "
    else:
        assert variant["lint_errors"], "lint refuses every one of them"
        said = "lint error not reproduced by the vendor's code"
    if stage is None:
        assert result.code == 0 and failed == [], text
        assert any(said in n for n in result.json()["notes"]), result.json()["notes"]
    else:
        assert result.code == 2 and [s["stage"] for s in failed] == [stage] and text in failed[0]["message"]


def test_attention_patches_with_vllms_own_metadata(cli, python: Path, corex_rootfs: Path,
                                                  flagship_args: list[str], tmp_path: Path) -> None:
    """The head_dim-256 SDPA fallback and the prefix dispatch, called as vLLM calls them (its XFormersMetadata,
    its paged-cache shape and views, non-contiguous blocks), return what dense attention returns."""
    got, record = run_on_patched_tree(cli, python, corex_rootfs, flagship_args, "runtime_attention.py", tmp_path)
    assert got["sdpa_fallback_1"]["max_abs_diff"] < 1e-5
    # switch off: the vendor's path runs, and its first call into ixformer's xFormers says what and where
    # switch off: the vendor's path runs; its mask is computed, and its prefill op, wrong on the image for
    # head_dim 256, refuses instead of computing what the image does not
    off = got["sdpa_fallback_0"]
    assert off["type"] == "FlashHeadDimError", off
    assert off["error"].startswith("ixformer's flash forward op is wrong for head_dim 256 > 128 on the image"), off
    assert got["prefix"]["max_abs_diff"] < 1e-5
    assert {"ixformer.contrib.xformers", "xformers.ops.fmha.attn_bias"} <= set(record["modules"])
    assert [(c["name"].rsplit(".", 1)[-1], c["where"].split(":")[0]) for c in record["calls"]] == [
        ("from_seqlens", "vllm/attention/backends/xformers.py"), ("FwOp", "vllm/attention/backends/xformers.py"),
        ("memory_efficient_attention_forward", "vllm/attention/backends/xformers.py")]  # the op made per call


def test_adapter_blocks_with_vllms_layers_switch_by_switch(cli, python: Path, corex_rootfs: Path,
                                                         flagship_args: list[str], tmp_path: Path) -> None:
    """The pinned adapter's MoE block with its experts held and loaded by vLLM's FusedMoE, its gated norm loaded
    by vLLM's loader, its GatedDeltaNet rule prefill then decode: each switch off and on gives the same outputs,
    and with it on the native path is what ran. vLLM's linear layer runs too: its forward calls ixformer's linear in
    the vendor tree, which the stand-in maps to torch's (and records)."""
    got, record = run_on_patched_tree(cli, python, corex_rootfs, flagship_args, "runtime_adapter.py", tmp_path)
    # mamba-cache-conv-zeroed: the state is zeros whatever the memory held (vLLM's profile run takes no slot)
    assert got.pop("MAMBA_CACHE") == {"finite": True}
    linear = got.pop("LINEAR")
    assert linear["max_abs_diff"] < 1e-5 and linear["smallest_output"] > 1e-3, linear
    mapped = [c for c in record["calls"] if c["name"] == "ixformer.functions.linear"]
    assert mapped and mapped[0]["mapped"] == "reference ixformer.functions.linear", record["calls"]
    assert mapped[0]["where"].startswith("vllm/model_executor/layers/linear.py:"), mapped
    assert sorted(got) == ["CHUNK_PARALLEL", "MOE_NATIVE", "RMSNORM_NATIVE"]
    for switch, result in got.items():
        assert result["smallest_output"] > 1e-3, switch  # not an all-zero output compared with itself
        assert result["max_abs_diff"] < 1e-4, (switch, result)
        assert result["native_ran_when_on"] and not result["native_ran_when_off"], (switch, result)


def test_real_roots_build_and_preflight_with_the_adapters_own_files(cli, python: Path, corex_rootfs: Path,
                                                                   adapter_args: list[str], transformers_455: Path,
                                                                   tmp_path: Path) -> None:
    """The vendor roots of an image (here the CoreX-like rootfs, as `vendor pull` lays it out, with its GPU-library
    imports): `build --rootfs` preflights an applied copy and leaves the roots alone; `preflight --rootfs` runs the
    applied roots; `build --source` without --rootfs runs the adapter's files on the reference."""
    site = transformers_site(corex_rootfs, transformers_455, full=True)
    args = [*adapter_args, "--package-root", f"transformers={site}"]
    before = tree_digest(corex_rootfs)
    result = cli("build", FLAGSHIP, "-o", tmp_path / "sub", "--rootfs", corex_rootfs, *args, "--json")
    assert result.code == 0, result.out[-3000:] + result.err[-3000:]
    said = [n for n in result.json()["notes"] if n.startswith("preflight: 1 variant(s) start")]
    assert len(said) == 1 and f"on a patched copy of the vendor roots under {corex_rootfs}" in said[0], said
    assert "not checked here" not in said[0]  # the adapter is here: its flag, parsers and model were checked
    assert tree_digest(corex_rootfs) == before
    # preflight runs the roots as they are: roots the recipe is not applied to are another submission's code
    unapplied = cli("preflight", FLAGSHIP, "--rootfs", corex_rootfs, *args, "--json")
    assert unapplied.code == 2 and "the recipe is not applied there" in unapplied.json()["error"], unapplied.out
    assert "toolkit apply" in unapplied.json()["fix"]

    assert cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *args).code == 0
    result = cli("preflight", FLAGSHIP, "--rootfs", corex_rootfs, *args, "--json")
    assert result.code == 0, result.out[-3000:] + result.err[-3000:]
    base = stages(by_variant(result)["base"])
    assert all(s["ok"] for s in base.values()), base
    assert base["architecture"]["message"].endswith("vllm.model_executor.models.qwen3_5.Qwen3_5MoeForCausalLM")
    assert base["reasoning-parser"]["ok"] and base["tool-parser"]["ok"]
    notes = result.json()["notes"]
    stood_in = "stood in for the image's GPU libraries (ixformer, xformers, triton)"
    assert any(n.startswith(stood_in) for n in notes), notes
    assert any(n.startswith("attention backend (every variant): vLLM selects XFORMERS (Cannot use FlashAttention-2")
               for n in notes), notes
    # the applied roots hold the bytes the build's patched copy held: the build's run is remembered
    assert notes[0].endswith("remembered from an earlier run on the same files"), notes[0]
    # one new file in the roots and the vendor's code runs again
    vendor = roots_of(corex_rootfs)[0] / "vllm"
    added = vendor / "toolkit_test_added.py"
    added.write_text(f"# {uuid.uuid4()}: bytes no earlier run saw\n")
    try:
        changed = cli("preflight", FLAGSHIP, "--rootfs", corex_rootfs, *args, "--json")
    finally:
        added.unlink()
    assert changed.code == 0 and not changed.json()["notes"][0].endswith("remembered from an earlier run on the "
                                                                          "same files"), changed.json()["notes"][0]
    assert by_variant(changed) == by_variant(result)
    # an applied file edited by hand is not the submission's code either, though every marker is in place
    model = vendor / "model_executor/models/qwen3_5.py"
    applied = model.read_bytes()
    model.write_bytes(applied.replace(b'env_int("BI100_DNN_CHUNK", 4096,', b'env_int("BI100_DNN_CHUNK", 2048,'))
    try:
        edited = cli("preflight", FLAGSHIP, "--rootfs", corex_rootfs, *args, "--json")
    finally:
        model.write_bytes(applied)
    assert edited.code == 2, edited.out[-3000:]
    assert "1 file(s) changed after the recipe was applied there" in edited.json()["error"], edited.out[-3000:]
    assert "vllm/model_executor/models/qwen3_5.py" in edited.json()["error"]
    # that the roots hold the adapter's files is checked against the adapter: without it, refused naming it (and
    # not as a tree to build: preflight builds none with --rootfs)
    bare = cli("preflight", FLAGSHIP, "--rootfs", corex_rootfs, "--package-root", f"transformers={site}", "--json")
    assert bare.code == 2 and "cannot check that the recipe is applied there" in bare.json()["error"], bare.out
    assert "source 'qwen36-adapter' is not available here" in bare.json()["error"]
    assert "--source qwen36-adapter=PATH" in bare.json()["fix"] and "would not be the submission's" not in bare.out

    # one verdict for one input: build on the roots apply just patched reaches apply's states (it once refused
    # the transformers root: "exists in the vendor roots with content this recipe did not deploy")
    again = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *args, "--json")
    seen = {state for state, count in again.json()["summary"].items() if count}
    assert again.code == 0 and seen <= {"ALREADY_APPLIED", "GATED_OFF"}, again.json()["summary"]
    built = cli("build", FLAGSHIP, "-o", tmp_path / "sub-applied", "--rootfs", corex_rootfs, *args, "--json")
    assert built.code == 0, built.out[-3000:] + built.err[-3000:]
    kv = {r["state"] for r in built.json()["results"] if r["transform"].startswith("hybrid-kv-accounting")}
    assert kv == {"ALREADY_APPLIED"}, built.json()["results"]
    assert any("start in the patched vLLM's own config code" in n and "(remembered from an earlier run)" in n
               for n in built.json()["notes"]), built.json()["notes"]

    result = cli("build", FLAGSHIP, "-o", tmp_path / "sub2", *adapter_args, "--json")
    assert result.code == 0, result.out[-3000:]
    said = [n for n in result.json()["notes"] if n.startswith("preflight: 1 variant(s) start")]
    assert len(said) == 1 and "on a patched copy of vllm==0.6.3 (CoreX-like)" in said[0], said
    assert "not checked here" not in said[0]


def test_a_failure_on_the_reference_says_it_is_not_the_image(cli, python: Path, vllm_063: Path,
                                                              tmp_path: Path) -> None:
    """A vendor tree the reference cannot import (here: the adapter's replacement written for another vLLM)
    fails naming the file, and says it ran on the reference, not on the image's files."""
    from pinned_adapter import add_commit, make_repo, source_file

    clone, _ = make_repo(tmp_path)  # its own: the session's repository keeps its history
    written = source_file("sequence.py")  # the pin's, CRLF: what the transforms edit is still there
    later = add_commit(clone, "sequence.py", b"from vllm.inputs import NotInThisRelease  # noqa\r\n" + written,
                       "sequence.py for another vLLM")
    result = cli("preflight", FLAGSHIP, "--source", f"qwen36-adapter={clone}@{later}", "--json")
    assert result.code == 2
    error = result.json()
    assert "vllm/sequence.py:1" in error["error"] and "NotInThisRelease" in error["error"], error
    assert "not on the image's own files" in error["fix"] and "toolkit vendor pull" in error["fix"], error


def test_ten_kv_caches_serve_the_hybrid_model_as_forty_did(cli, python: Path, corex_rootfs: Path,
                                                          adapter_args: list[str], transformers_455: Path,
                                                          tmp_path: Path) -> None:
    """Through vLLM's own code with the patched config (transformers 4.55.3 + the adapter's config packages +
    the hybrid-kv-accounting transforms): full_attention counts 10 layers (163,840 B per block at TP 4), and the
    vendor's CacheEngine allocates 10 caches; the pinned adapter's model (linear layers on the mamba state,
    full-attention layers on kv_caches[attn_idx]) gives the same tokens and logits over them as over legacy40's
    40; a mutant that indexes the caches by layer number fails on 10."""
    site = transformers_site(corex_rootfs, transformers_455, full=True)
    assert cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *adapter_args,
               "--package-root", f"transformers={site}").code == 0
    env = dict(runtime_env(tmp_path, site, roots_of(corex_rootfs)[1], cpu_device=True),
               VLLM_ATTENTION_BACKEND="XFORMERS")
    proc = subprocess.run([str(python), str(REPO / "tests" / "runtime_kv.py")], capture_output=True, text=True,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    full, legacy = got["full_attention"], got["legacy40"]
    assert (full["attention_layers"], full["block_bytes"], full["allocated_caches"]) == (10, 163840, 10)
    assert (legacy["attention_layers"], legacy["block_bytes"], legacy["allocated_caches"]) == (40, 655360, 40)
    assert full["tokens"] == legacy["tokens"] and got["max_abs_logit_diff"] == 0.0
    assert full["smallest_logit_spread"] > 1e-3  # real logits, not a constant compared with itself
    assert len(set(map(tuple, full["tokens"]))) > 1  # the greedy tokens change from step to step
    assert full["mutant"].startswith("IndexError"), full["mutant"]


# -- the image as it is: triton, the emulation in every Python, the backend the vendor's selector takes -----------

def _base_stage(result: Any, name: str) -> dict[str, Any]:
    return stages(by_variant(result)["base"])[name]


def test_the_vendor_selector_takes_xformers_because_the_image_lacks_flash_attention(cli, python: Path,
                                                                                    adapter_args: list[str]) -> None:
    """On the CoreX-like tree (capability [9, 0], the selector importing the flash_attn backend), the recipe's
    `absent` ixformer.contrib.vllm_flash_attn fails to import as on the image: XFORMERS, for the vendor's reason."""
    result = cli("preflight", FLAGSHIP, *adapter_args, "--json")
    assert result.code == 0, result.out[-3000:] + result.err[-2000:]
    stage = _base_stage(result, "attention-backend")
    assert stage["ok"] and stage["message"].startswith(
        "vLLM selects XFORMERS (Cannot use FlashAttention-2 backend because the vllm.vllm_flash_attn package is "
        "not found."), stage
    notes = result.json()["notes"]
    assert any(n.startswith("attention backend (every variant): vLLM selects XFORMERS (") for n in notes), notes
    assert any("per card" in n for n in notes)  # and the vendor's KV numbers


def test_without_absent_the_selector_would_take_flash_attention(cli, python: Path, adapter_args: list[str],
                                                                tmp_path: Path) -> None:
    """The fix removed: a stand-in that lets ixformer.contrib.vllm_flash_attn import makes the vendor's selector
    take FLASH_ATTN, which the image cannot load (the false CANNOT START of the issue)."""
    def present(data: dict[str, Any]) -> None:
        data["base_image"]["gpu_libraries"][0].pop("absent")

    result = cli("preflight", recipe_copy(tmp_path, present), *adapter_args, "--json")
    assert result.code == 2
    stage = _base_stage(result, "attention-backend")
    assert not stage["ok"] and stage["message"].startswith("vLLM selects FLASH_ATTN (its first choice, nothing "
                                                           "ruled out), which the image cannot load"), stage


def test_without_triton_the_vendor_triton_utils_cannot_import(cli, python: Path, adapter_args: list[str],
                                                               tmp_path: Path) -> None:
    """The fix removed: the vendor's triton_utils imports triton unconditionally."""
    def no_triton(data: dict[str, Any]) -> None:
        data["base_image"]["gpu_libraries"] = [g for g in data["base_image"]["gpu_libraries"] if g["name"] != "triton"]

    result = cli("preflight", recipe_copy(tmp_path, no_triton), *adapter_args, "--json")
    assert result.code == 2
    error = result.json()["error"]
    assert error.startswith("the patched tree imports 'triton' at vllm/triton_utils/custom_cache_manager.py:3"), error
    assert "add triton to base_image.gpu_libraries" in result.json()["fix"]


CHILD_CHECK = """
import json, os, sys
from vllm.model_executor.models import registry
from vllm.model_executor.models.registry import ModelRegistry
# the vendor's own fresh child Python, not the fork the runtime gives it (registry-check-forked): a fork inherits
# everything, a new interpreter only the environment
registry._run_in_subprocess = registry._run_in_subprocess.__wrapped__
if sys.argv[1] == "parent-only":  # the emulation this process has, not passed on (what preflight did before)
    os.environ.pop("TOOLKIT_EMULATED_DEVICES")
try:
    info = ModelRegistry.inspect_model_cls(["Qwen2ForCausalLM"])  # vLLM inspects it in a child Python
    print(json.dumps({"ok": True, "cls": type(info).__name__}))
except Exception as exc:
    print(json.dumps({"ok": False, "error": str(exc)[-3000:]}))
"""


def test_every_python_the_runtime_starts_sees_the_emulated_devices(python: Path, corex_rootfs: Path,
                                                                   tmp_path: Path) -> None:
    """The vendor's platform code imports pynvml at module level and takes CUDA when it fails; vLLM 0.6.3 inspects a
    model class in a child Python. With the emulation in the environment the child sees the devices; with it only in
    the parent, the child dies on pynvml and the vendor says the architecture is not supported."""
    env = runtime_env(tmp_path, roots_of(corex_rootfs)[1])
    got = {}
    for mode in ("inherited", "parent-only"):
        proc = subprocess.run([str(python), "-c", CHILD_CHECK, mode], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["inherited"] == {"ok": True, "cls": "_ModelInfo"}, got
    # the symptom: the vendor refuses the very architecture it lists (the child died on pynvml)
    error = got["parent-only"]["error"]
    assert not got["parent-only"]["ok"] and error.startswith(
        "Model architectures ['Qwen2ForCausalLM'] are not supported for now. Supported architectures: ["), got
    assert "'Qwen2ForCausalLM'" in error.split("Supported architectures: ", 1)[1], error


def test_max_completion_tokens_alone_limits_the_answer(cli, python: Path, corex_rootfs: Path, flagship_args: list[str],
                                                       tmp_path: Path) -> None:
    """The patched protocol (the adapter's protocol.py with the image layer's edits) reads max_completion_tokens
    where a request gives no max_tokens; without the three openai-max-completion-tokens transforms (unknown fields
    still ignored) it drops it, and the answer would run to the context's end."""
    without = tmp_path / "without"
    shutil.copytree(corex_rootfs, without / "rootfs", symlinks=True)
    got, _ = run_on_patched_tree(cli, python, corex_rootfs, flagship_args, "runtime_protocol.py", tmp_path)
    assert got == {"sampling": 5, "beam": 5}, got
    recipe = recipe_copy(without / "recipe", lambda d: d.__setitem__("transforms", [
        t for t in d["transforms"] if not t["id"].startswith("openai-max-completion-tokens")]))
    assert cli("apply", recipe, "--rootfs", without / "rootfs", *flagship_args).code == 0
    proc = subprocess.run([str(python), str(REPO / "tests" / "runtime_protocol.py")], capture_output=True, text=True,
                          env=runtime_env(without, roots_of(without / "rootfs")[1]))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == {"sampling": 1000, "beam": 1000}


def test_a_short_context_copy_preflights_with_a_warning_that_it_is_not_a_submission(
        cli, python: Path, adapter_args: list[str], tmp_path: Path) -> None:
    """Only the platform's workload needs 235,000 tokens of context: vLLM starts the copy, so preflight runs it and
    says it would not be accepted (build refuses it: tests/test_lint.py)."""
    recipe = recipe_copy(tmp_path, lambda d: d["serve"]["args"].update({"max-model-len": 100000}))
    result = cli("preflight", recipe, *adapter_args, "--json")
    assert result.code == 0, result.out[-3000:] + result.err[-2000:]
    [variant] = result.json()["variants"]
    assert variant["starts"] and variant["lint_errors"] == [] and variant["config"]["max_model_len"] == 100000
    [said] = variant["not_a_submission"]
    assert said.startswith("context-length: max_model_len 100000 refuses the workload's largest request (254,336 "
                           "prompt tokens with a 4,096-token completion limit: 258,432 tokens)")
    assert f"base: preflighted, but not a submission: {said}" in result.json()["notes"]
