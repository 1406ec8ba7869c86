"""The flagship's served path on a CPU (`pytest -k generate`): vLLM 0.6.3's own LLMEngine over the CoreX-like tree
patched by recipes/bi100-qwen36.yaml with the pinned adapter (its model built from vLLM's layers, full attention
through the vendor's xFormers backend, GatedDeltaNet state in the mamba cache, the flagship's prefix-state and native
fast-path transforms in place), and a tiny checkpoint of the composite hybrid config under the published tensor
names (toolkit/runtime/tiny_model.py), loaded by the adapter's load_weights rules. Each generated token is checked
against a recompute (the prompt plus the tokens so far sent alone to a fresh engine: no cache, no prefix hit, no
chunking), so the paged KV cache, the decode reference and the linear-attention state carried step to step are
checked against a full prefill; then TP 2 and the prefix cache off give the same tokens, and a checkpoint whose
names the loader skips fails the start. The harness and its comparisons are test_generate.py's; transformers has
no class for this model, so there is no transformers reference here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import FLAGSHIP, roots_of, transformers_site
from test_generate import (
    ALL_REFERENCES,
    cpu_served,
    mismatches,
    rewritten_checkpoint,
    run,
    same_tokens_cache_off_and_at_tp2,
    tp1_and_off,
)

from toolkit.cli import main
from toolkit.errors import ToolkitError
from toolkit.recipe import load_recipe
from toolkit.runtime import cpu_device, standins, tiny_model

# the vendor's ops on the flagship's path: linear, the KV write and the decode attention (its norms, activations and,
# since 2f7d5f5, its interleaved MRoPE are the adapter's torch code); not ixformer's flash prefill op, which is wrong
# at head size 256: the flagship's xformers-sdpa-fallback computes prefills instead
FLASH_PREFILL = "ixformer.contrib.xformers.ops.memory_efficient_attention_forward"
FLAGSHIP_REFERENCES = ALL_REFERENCES - {"ixformer.functions.rms_norm", "ixformer.functions.fused_add_rms_norm",
                                        "ixformer.functions.silu_and_mul",
                                        "ixformer.functions.vllm_rotary_embedding_neox", FLASH_PREFILL}
# the MTP tensors, as the adapter's loader skips them (it loads the vision tower since 2f7d5f5)
SKIPPED = {"mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.mlp.gate.weight"}


@pytest.fixture(scope="module")
def flagship(tmp_path_factory: pytest.TempPathFactory, corex_template: Path, adapter_args: list[str],
             transformers_455: Path) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("generate-flagship")
    rootfs = work / "rootfs"
    shutil.copytree(corex_template, rootfs, symlinks=True)
    site = transformers_site(rootfs, transformers_455, full=True)
    assert main(["apply", str(FLAGSHIP), "--rootfs", str(rootfs), *adapter_args,
                 "--package-root", f"transformers={site}"]) == 0
    return {**cpu_served(work, FLAGSHIP, [site, roots_of(rootfs)[1]]), "rootfs": rootfs}


@pytest.fixture(scope="module")
def tp1(flagship: dict[str, Any]) -> dict[str, Any]:
    return tp1_and_off(flagship, reference=False)


def test_flagship_generation_matches_the_recompute_at_tp1(tp1: dict[str, Any]) -> None:
    print(json.dumps({k: tp1[k] for k in ("outputs", "prefix_hit_rate", "cache")}, indent=1))
    assert not mismatches(tp1["outputs"], tp1["oracle"])
    assert len(set(tp1["outputs"]["0"]["tokens"])) > 1
    assert tp1["prefix_hit_rate"] > 0  # the later request's two blocks (and its GatedDeltaNet state) were reused
    record = tp1["record"]
    assert set(record["computed"]) >= FLAGSHIP_REFERENCES and FLASH_PREFILL not in record["computed"], sorted(
        record["computed"])
    assert not [c for c in record["calls"] if not c["mapped"]]
    assert set(record["shims"]) == {*cpu_device.SHIMS, *cpu_device.CHECKS, *cpu_device.FORCING, standins.REGISTRY_SHIM}
    load = record["load"]
    assert not load["unwritten"] and not load["unused"] and load["parameters"] > 0, load
    assert set(load["skipped"]) == SKIPPED


def test_flagship_prefix_cache_off_and_tp2_give_the_same_tokens(flagship: dict[str, Any],
                                                               tp1: dict[str, Any]) -> None:
    same_tokens_cache_off_and_at_tp2(flagship, tp1, reference=False)


def test_a_tensor_name_the_adapters_loader_skips_fails_the_start(flagship: dict[str, Any], tmp_path: Path) -> None:
    # the shared expert's gate under another name: the adapter's loader skips it silently, and the row of the fused
    # router/shared gate it fills (since 2f7d5f5) stays NaN
    name = "model.language_model.layers.1.mlp.shared_expert_gate.weight"
    wrong = name.replace("shared_expert_gate", "shared_expert_gating")
    renamed = rewritten_checkpoint(flagship, tmp_path / "renamed", f"tensors['{wrong}'] = tensors.pop('{name}')")
    result = run(flagship, "renamed", model=str(renamed), reference=False)
    assert result["code"] != 0
    assert "UnwrittenParameters: 1 of " in result["stderr"], result["stderr"][-3000:]
    assert "model.layers.1.mlp.router_shared_gate.weight" in result["stderr"]


def test_a_wrong_decode_reference_fails_the_flagship_generation_check(flagship: dict[str, Any]) -> None:
    # the flagship's decode attention is the vendor's op (16 query heads on 2 KV heads): its head mapping ignored
    result = run(flagship, "head-mapping-ignored", mutant="head-mapping-ignored", prefix_caching=False, oracle=True,
                 reference=False)
    assert result["code"] == 0, result["stderr"][-4000:]
    assert mismatches(result["outputs"], result["oracle"])


def _real_config(flagship: dict[str, Any], folder: Path, extra: list[str]) -> Path:
    """A served checkpoint's config folder as a user has it: config.json and the index, at the real model's 40
    layers, with layer 0's experts stored one tensor per expert (the other form the loader takes), and `extra`."""
    spec = tiny_model.tiny_spec(load_recipe(FLAGSHIP).recipe.model, 2)
    names = list(tiny_model.hybrid_tensors({**spec, "num_hidden_layers": 40, "num_experts": 256}))
    fused = [n for n in names if n.startswith("model.language_model.layers.0.mlp.experts.")]
    names = [n for n in names if n not in fused] + [
        f"model.language_model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(256)
        for p in ("gate_proj", "up_proj", "down_proj")] + extra
    folder.mkdir()
    shutil.copy(flagship["model"] / "config.json", folder / "config.json")
    index = {"metadata": {}, "weight_map": {name: "model-00001-of-00001.safetensors" for name in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def test_a_real_index_gives_the_tiny_checkpoint_its_names(flagship: dict[str, Any], tmp_path: Path) -> None:
    """The tiny checkpoint takes the index's names exactly (layer 0's experts one tensor per expert, the loader's
    other form: all written), and a tensor of it the adapter's model has no parameter for, which the loader skips
    silently, stops the start; without the check the same checkpoint serves."""
    recipe = load_recipe(FLAGSHIP).recipe
    # a norm's bias: no Qwen3.5 norm has one, and the loader's last rule skips a name it has no parameter for (a
    # projection's bias it refuses itself since 2f7d5f5: the fused GatedDeltaNet and q/gate/k/v loaders raise)
    unknown = "model.language_model.layers.2.post_attention_layernorm.bias"
    spec = tiny_model.tiny_spec(recipe.model, 2, _real_config(flagship, tmp_path / "real", [unknown]))
    assert {"model.language_model.layers.0.mlp.experts.7.down_proj.weight", unknown} <= set(spec["tensor_names"])
    assert not [n for n in spec["tensor_names"] if ".layers.8." in n or ".experts.8." in n]
    model = tiny_model.build(spec, flagship["python"], tmp_path / "tiny")
    result = run(flagship, "real-names", model=str(model), reference=False, max_tokens=2)
    assert result["code"] != 0
    assert f"were read by Qwen3_5MoeForCausalLM's loader and written nowhere: {unknown};" in result["stderr"], (
        result["stderr"][-3000:])
    assert "UnusedTensors: 1 of " in result["stderr"] and "UnwrittenParameters" not in result["stderr"]
    unchecked = run(flagship, "real-names-unchecked", model=str(model), reference=False, max_tokens=2,
                    without="load-check")
    assert unchecked["code"] == 0, "without the check the same checkpoint loads and serves, silently"


def test_a_model_config_of_another_architecture_is_refused(tmp_path: Path) -> None:
    recipe = load_recipe(FLAGSHIP).recipe
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}))
    with pytest.raises(ToolkitError, match=r"config.json declares Qwen2ForCausalLM \(qwen2\), the recipe serves "
                                           r"Qwen3_5MoeForCausalLM \(qwen3_5_moe\)"):
        tiny_model.tiny_spec(recipe.model, 2, tmp_path)
    with pytest.raises(ToolkitError, match="does not exist"):
        tiny_model.tiny_spec(recipe.model, 2, tmp_path / "missing")
