"""A tiny checkpoint of the recipe's model architecture, for running the served path on a CPU.

What the served code depends on is kept: the architecture and model_type, the head size, the ratio of query to KV
heads, the served dtype, the tensor names of the published checkpoint (the names a loader's `load_weights` maps),
the family's special tokens; everything else is shrunk (a vocabulary of a few hundred). The KV heads are the
tensor-parallel size, so every rank holds whole heads. Seeded: the same spec gives the same bytes. Built by the CPU
runtime's Python (run as a script), cached by the spec's content hash, built once (`inputs.cached_tree`).

Two families:
- a single config (Qwen2): 4 layers, transformers builds the model from its config and writes it;
- the composite hybrid config (Qwen3.5/3.6, `model.text_config`): the text model under `text_config` with a
  `vision_config` beside it, 8 layers with full attention every `full_attention_interval`, GatedDeltaNet layers with
  the recipe's key-to-value head ratio, 8 experts (top 2) and a shared expert. The image's transformers has no
  model class for it (the adapter adds config classes only), so the tensors are written here under the published
  checkpoint's names (`model.language_model.*`, fused experts, the shared expert, and the vision and MTP tensors
  the adapter's loader skips: `hybrid_tensors`). The linear-attention projections are Qwen3.5's (in_proj_qkv: all
  q, all k, all v; in_proj_z, in_proj_b, in_proj_a), as upstream vLLM's qwen3_5.py loader names them; no Qwen3.6
  checkpoint index is in this repository to check the whole list against.

With a model config folder (the served checkpoint's config.json and model.safetensors.index.json), the head ratios
and layer pattern are the real config's and the tensor names the index's, exactly (those of the layers and experts
the tiny model has), each shaped as the published name it matches: a loader that skips one of them silently is
caught by the load check. A name matching no published tensor is written as a vector and listed, so a loader that
takes it stops with a shape error naming it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
# the vision tokens of the family (a multimodal model's profile run places an image's tokens between them)
VISION_TOKENS = {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
                 "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] if m['content'] is string else '' }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LAYERS = 4
HYBRID_LAYERS = 8
HYBRID_HIDDEN = 64
HYBRID_EXPERTS = 8
VOCAB = 640
# the positions the tiny model takes: an agent's prompt (29 tool schemas) is about 7,000 of its tokens
POSITIONS = 16384
SEED = 0


def kv_heads(kv: int, tp: int, served_tp: int | None) -> int:
    """The tiny model's KV heads at `tp`: one a rank, or, where the served model has fewer KV heads than its
    `served_tp` ranks (2 at TP 4: each KV head replicated on two ranks), as many ranks sharing each one as there
    (one KV head at TP 2), so the replicated layout the target runs is the one rehearsed."""
    from toolkit.errors import ToolkitError

    if served_tp is None or kv >= served_tp:
        return tp
    if served_tp % kv:
        raise ToolkitError(f"{kv} KV heads do not replicate evenly over {served_tp} ranks",
                           hint="vLLM needs the tensor-parallel size to be a multiple of the KV heads below it")
    return max(1, tp // (served_tp // kv))


def tiny_spec(model: Any, tp: int, model_config: Path | None = None, served_tp: int | None = None) -> dict[str, Any]:
    """The tiny model's spec from the recipe's `model:` (a ModelShape) at tensor-parallel size `tp` (`served_tp`:
    the recipe's own, whose relation to the KV heads the tiny model keeps, see `kv_heads`); with
    `model_config`, a folder holding the served model's real config.json (and, when present, its
    model.safetensors.index.json), the shape ratios and layer pattern are the real config's and, for the composite
    hybrid config, the tensor names the index's, exactly (see `real_names`; a single config's names are the ones
    transformers writes)."""
    from toolkit.errors import ToolkitError

    if model_config is not None:
        model = _with_real_config(model, model_config)
    if model.architecture is None or model.model_type is None:
        raise ToolkitError("a tiny model needs the served model's architecture and model_type",
                           hint="set model.architecture and model.model_type in the recipe")
    heads = model.num_attention_heads or model.hidden_size // model.head_dim
    if heads % model.num_kv_heads:
        raise ToolkitError(f"{heads} query heads do not split over {model.num_kv_heads} KV heads")
    ratio = heads // model.num_kv_heads
    kv = kv_heads(model.num_kv_heads, tp, served_tp)
    if (ratio * kv) % tp:
        raise ToolkitError(f"{ratio * kv} query heads of the tiny model do not split over {tp} ranks")
    spec = {"architecture": model.architecture, "model_type": model.model_type, "dtype": model.dtype,
            "head_dim": model.head_dim, "num_key_value_heads": kv, "num_attention_heads": ratio * kv,
            "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "seed": SEED}
    if not model.text_config and model.linear_attention is None:
        return spec
    linear = model.linear_attention
    if not model.text_config or linear is None:
        raise ToolkitError(f"no tiny checkpoint for {model.architecture}: only the composite hybrid config "
                           "(text_config with linear attention, Qwen3.5/3.6) and single attention configs are built",
                           hint="declare both model.text_config and model.linear_attention, or neither")
    if linear.num_value_heads % linear.num_key_heads:
        raise ToolkitError(f"{linear.num_value_heads} linear-attention value heads do not split over "
                           f"{linear.num_key_heads} key heads")
    # key and value head dims differ, so a transposed recurrent state cannot pass
    return {**spec, "composite": True, "num_hidden_layers": HYBRID_LAYERS, "hidden_size": HYBRID_HIDDEN,
            "full_attention_interval": model.full_attention_interval,
            "linear_num_key_heads": tp, "linear_num_value_heads": tp * linear.num_value_heads // linear.num_key_heads,
            "linear_key_head_dim": 32, "linear_value_head_dim": 64, "linear_conv_kernel_dim": linear.conv_kernel,
            "num_experts": HYBRID_EXPERTS, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            **({"tensor_names": real_names(model_config)} if model_config and _index(model_config).is_file() else {})}


def wide_config(model: Any, model_config: Path | None = None) -> tuple[dict[str, Any], int]:
    """The config.json of the served model at its real widths with one full-attention interval of layers (what
    `toolkit estimate` counts, each layer kind once; the weights are vLLM's dummy ones), and the served model's
    layer count: the checkpoint's own config cut to those layers where `model_config` is given, else built from the
    recipe's `model:` (the composite hybrid config, which needs `moe` and `vocab_size` there)."""
    from toolkit.errors import ToolkitError

    if model_config is not None:
        config = _read_json(model_config / "config.json")
        text = config.get("text_config", config)
        layers = int(text["num_hidden_layers"])
        interval = int(text.get("full_attention_interval", 1))
        text["num_hidden_layers"] = interval
        if isinstance(text.get("layer_types"), list):
            text["layer_types"] = text["layer_types"][:interval]
        return dict(config), layers
    if not model.text_config or model.linear_attention is None:
        raise ToolkitError(f"no wide model of {model.architecture} without its config: the recipe's `model:` "
                           "describes only the composite hybrid config (Qwen3.5/3.6) fully",
                           hint="pass --model-config DIR (the checkpoint's config.json)")
    if model.moe is None or model.vocab_size is None:
        raise ToolkitError("the recipe's model: gives no moe (experts, top-k, widths) or vocab_size, which the wide "
                           "model is built at", hint="add them under model:, or pass --model-config DIR")
    widths = model.hybrid_config()
    assert widths is not None  # what it needs is checked above, each with its own hint
    spec = {"architecture": model.architecture, "model_type": model.model_type, "dtype": model.dtype, **widths}
    return _hybrid_config(spec, {"bos_token_id": 0, "eos_token_id": 1}), model.num_layers


def _index(folder: Path) -> Path:
    return folder / "model.safetensors.index.json"


def _read_json(path: Path) -> Any:
    from toolkit.errors import ToolkitError

    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ToolkitError(f"{path} does not exist", hint="the model config folder holds the served "
                           "checkpoint's config.json (and its model.safetensors.index.json)") from None
    except (OSError, ValueError) as exc:
        raise ToolkitError(f"{path} is not readable JSON: {exc}") from None


def _with_real_config(model: Any, folder: Path) -> Any:
    """The recipe's model shape with the real config.json's architecture, heads, head size, layer pattern and
    linear-attention heads; a config of another architecture than the recipe's is refused."""
    from toolkit.errors import ToolkitError

    path = folder / "config.json"
    config = _read_json(path)
    architecture = (config.get("architectures") or [None])[0]
    if (architecture, config.get("model_type")) != (model.architecture, model.model_type):
        raise ToolkitError(f"{path} declares {architecture} ({config.get('model_type')}), the recipe serves "
                           f"{model.architecture} ({model.model_type})",
                           hint="give the served checkpoint's config folder, or fix model: in the recipe")
    text = config.get("text_config", config)
    update: dict[str, Any] = {"text_config": "text_config" in config}
    for field, key in (("num_attention_heads", "num_attention_heads"), ("num_kv_heads", "num_key_value_heads"),
                       ("head_dim", "head_dim"), ("full_attention_interval", "full_attention_interval")):
        if key in text:
            update[field] = text[key]
    if model.linear_attention is not None and "linear_num_key_heads" in text:
        update["linear_attention"] = model.linear_attention.model_copy(update={
            "num_key_heads": text["linear_num_key_heads"], "num_value_heads": text["linear_num_value_heads"],
            "conv_kernel": text.get("linear_conv_kernel_dim", model.linear_attention.conv_kernel)})
    return model.model_copy(update=update)


def real_names(folder: Path) -> list[str]:
    """The index's tensor names the tiny model keeps: every name outside the text layers and experts, and those of
    the text layers and experts the tiny model has (layer < HYBRID_LAYERS, expert < HYBRID_EXPERTS), spelled
    exactly."""
    names = _read_json(_index(folder)).get("weight_map", {})
    kept = []
    for name in sorted(names):
        layer = re.search(r"^model\.language_model\.layers\.(\d+)\.", name)
        expert = re.search(r"\.mlp\.experts\.(\d+)\.", name)
        if (layer is None or int(layer[1]) < HYBRID_LAYERS) and (expert is None or int(expert[1]) < HYBRID_EXPERTS):
            kept.append(name)
    return kept


def build(spec: dict[str, Any], python: Path, cache: Path) -> Path:
    """The checkpoint folder for `spec` under `cache`, built once by `python` (the CPU runtime)."""
    from toolkit.errors import ToolkitError
    from toolkit.inputs import cached_tree
    from toolkit.pyenv import build_key, script

    target = cache / f"tiny-{spec['model_type']}-{build_key(json.dumps(spec, sort_keys=True), files=[Path(__file__)])}"

    def write(tree: Path, scratch: Path) -> None:
        print(f"[tiny-model] building {spec['architecture']} ({spec['num_hidden_layers']} layers, "
              f"{spec['num_attention_heads']}:{spec['num_key_value_heads']} heads of {spec['head_dim']}) in {target}",
              file=sys.stderr)
        proc = subprocess.run(script(python, Path(__file__), json.dumps(spec), str(tree)), capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise ToolkitError(f"building the tiny {spec['architecture']} failed:\n{proc.stderr[-3000:]}")

    return cached_tree(target, write)


# -- run in the CPU runtime -------------------------------------------------------------------------------------

CORPUS = ("the model serves tokens on a card ; every request streams its answer , and the cache keeps blocks of "
          "keys and values for prefixes that repeat . tools are called with arguments in json")


# what function schemas are made of (JSON, its keys and types), so a request with many tools stays within the tiny
# model's positions
SCHEMA = ('{"type": "function", "function": {"name": "get_time", "description": "get time: a tool the assistant may '
          'call", "parameters": {"type": "object", "properties": {"arg_0": {"type": "integer", "description": '
          '"parameter 0 of get_time: what the call needs to know"}, "arg_1": {"type": "string"}}, "required": '
          '["arg_0", "arg_1"]}}}')


def _corpus() -> list[str]:
    words = CORPUS.split()
    return [" ".join(words[i:] + words[:i]) for i in range(len(words))] + [SCHEMA] * 20


def _tokenizer(out: Path) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    # one token each but not special, as in the family's tokenizer: a server that skips special tokens when it
    # detokenizes keeps these, so the reasoning and tool parsers see the tags
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS.values()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def _rope_parameters(head_dim: int) -> dict[str, Any]:
    """As the published config nests them (the adapter reads them there since 2f7d5f5): a quarter of each head
    rotated, its frequencies split over the three MRoPE axes (time, height, width; 11, 11, 10 at head size 256)."""
    half = int(head_dim * 0.25) // 2
    sections = [half // 3 + (1 if i < half % 3 else 0) for i in range(3)]
    return {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
            "mrope_section": sections, "mrope_interleaved": True}


def _hybrid_config(spec: dict[str, Any], specials: dict[str, int]) -> dict[str, Any]:
    interval = spec["full_attention_interval"]
    layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                   for i in range(spec["num_hidden_layers"])]
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "vocab_size", "full_attention_interval", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts",
            "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
    text = {key: spec[key] for key in keys} | {
        "model_type": f"{spec['model_type']}_text", "layer_types": layer_types, "max_position_embeddings": POSITIONS,
        "rms_norm_eps": 1e-6, "rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "tie_word_embeddings": False,
        "rope_parameters": _rope_parameters(spec["head_dim"]), "torch_dtype": spec["dtype"], **specials}
    return {"architectures": [spec["architecture"]], "model_type": spec["model_type"], "torch_dtype": spec["dtype"],
            "tie_word_embeddings": False, "text_config": text,
            "vision_config": _vision_config(spec), **specials}


# a vision tower small enough to be cheap and whole, so a loader that loads it (the adapter since 2f7d5f5) writes
# every parameter: 4 heads (any TP up to 4 divides them), the real 16x16 patches over 2 frames (the max-size
# profile image then gives the 1280 tokens the adapter reserves), a 4x4 grid of positions
VISION = {"depth": 1, "hidden_size": 16, "num_heads": 4, "intermediate_size": 32, "in_channels": 3,
          "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 16}
# the image processor the adapter's input mapper loads from the checkpoint folder, at the tower's patch shape
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": VISION["patch_size"],
                "merge_size": VISION["spatial_merge_size"], "temporal_patch_size": VISION["temporal_patch_size"],
                "min_pixels": 65536, "max_pixels": 16777216, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
                "do_normalize": True, "do_convert_rgb": True}


def _vision_config(spec: dict[str, Any]) -> dict[str, Any]:
    return vision_config(spec["model_type"], spec["hidden_size"])


def vision_config(model_type: str, out_hidden_size: int) -> dict[str, Any]:
    """The tiny vision tower's config.json entry: without one the adapter builds its default tower (27 blocks of
    width 1152, about 400M parameters), which dominates a tiny model's start."""
    return {"model_type": model_type, **VISION, "out_hidden_size": out_hidden_size}


def vision_tensors(spec: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The published checkpoint's vision tower (Qwen3.5/3.6 `model.visual.*`) at the tiny VISION shape."""
    v, out = VISION, spec["hidden_size"]
    dim, inter, merged = v["hidden_size"], v["intermediate_size"], v["hidden_size"] * v["spatial_merge_size"] ** 2
    pre = "model.visual"
    names: dict[str, tuple[int, ...]] = {
        f"{pre}.patch_embed.proj.weight": (dim, v["in_channels"], v["temporal_patch_size"], v["patch_size"],
                                           v["patch_size"]),
        f"{pre}.patch_embed.proj.bias": (dim,), f"{pre}.pos_embed.weight": (v["num_position_embeddings"], dim),
        f"{pre}.merger.norm.weight": (dim,), f"{pre}.merger.norm.bias": (dim,),
        f"{pre}.merger.linear_fc1.weight": (merged, merged), f"{pre}.merger.linear_fc1.bias": (merged,),
        f"{pre}.merger.linear_fc2.weight": (out, merged), f"{pre}.merger.linear_fc2.bias": (out,)}
    for i in range(v["depth"]):
        block = f"{pre}.blocks.{i}"
        names |= {f"{block}.norm1.weight": (dim,), f"{block}.norm1.bias": (dim,), f"{block}.norm2.weight": (dim,),
                  f"{block}.norm2.bias": (dim,), f"{block}.attn.qkv.weight": (3 * dim, dim),
                  f"{block}.attn.qkv.bias": (3 * dim,), f"{block}.attn.proj.weight": (dim, dim),
                  f"{block}.attn.proj.bias": (dim,), f"{block}.mlp.linear_fc1.weight": (inter, dim),
                  f"{block}.mlp.linear_fc1.bias": (inter,), f"{block}.mlp.linear_fc2.weight": (dim, inter),
                  f"{block}.mlp.linear_fc2.bias": (dim,)}
    return names


def hybrid_tensors(spec: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The published Qwen3.5/3.6 MoE checkpoint's tensor names and their shapes, for `spec`."""
    hidden, head_dim, text = spec["hidden_size"], spec["head_dim"], "model.language_model"
    hk, hv = spec["linear_num_key_heads"], spec["linear_num_value_heads"]
    dk, dv, kernel = spec["linear_key_head_dim"], spec["linear_value_head_dim"], spec["linear_conv_kernel_dim"]
    experts, inter, shared = spec["num_experts"], spec["moe_intermediate_size"], spec["shared_expert_intermediate_size"]
    vocab = spec["vocab_size"]
    names: dict[str, tuple[int, ...]] = {f"{text}.embed_tokens.weight": (vocab, hidden),
                                         f"{text}.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    for i in range(spec["num_hidden_layers"]):
        layer = f"{text}.layers.{i}"
        names |= {f"{layer}.input_layernorm.weight": (hidden,), f"{layer}.post_attention_layernorm.weight": (hidden,),
                  f"{layer}.mlp.gate.weight": (experts, hidden),
                  f"{layer}.mlp.experts.gate_up_proj": (experts, 2 * inter, hidden),
                  f"{layer}.mlp.experts.down_proj": (experts, hidden, inter),
                  f"{layer}.mlp.shared_expert.gate_proj.weight": (shared, hidden),
                  f"{layer}.mlp.shared_expert.up_proj.weight": (shared, hidden),
                  f"{layer}.mlp.shared_expert.down_proj.weight": (hidden, shared),
                  f"{layer}.mlp.shared_expert_gate.weight": (1, hidden)}
        if (i + 1) % spec["full_attention_interval"] == 0:
            heads, kv = spec["num_attention_heads"], spec["num_key_value_heads"]
            names |= {f"{layer}.self_attn.q_proj.weight": (2 * heads * head_dim, hidden),
                      f"{layer}.self_attn.k_proj.weight": (kv * head_dim, hidden),
                      f"{layer}.self_attn.v_proj.weight": (kv * head_dim, hidden),
                      f"{layer}.self_attn.o_proj.weight": (hidden, heads * head_dim),
                      f"{layer}.self_attn.q_norm.weight": (head_dim,), f"{layer}.self_attn.k_norm.weight": (head_dim,)}
        else:
            conv = hk * 2 * dk + hv * dv
            names |= {f"{layer}.linear_attn.in_proj_qkv.weight": (conv, hidden),
                      f"{layer}.linear_attn.in_proj_z.weight": (hv * dv, hidden),
                      f"{layer}.linear_attn.in_proj_b.weight": (hv, hidden),
                      f"{layer}.linear_attn.in_proj_a.weight": (hv, hidden),
                      f"{layer}.linear_attn.conv1d.weight": (conv, 1, kernel),
                      f"{layer}.linear_attn.A_log": (hv,), f"{layer}.linear_attn.dt_bias": (hv,),
                      f"{layer}.linear_attn.norm.weight": (dv,),
                      f"{layer}.linear_attn.out_proj.weight": (hidden, hv * dv)}
    # the vision tower (skipped by name by the adapter's loader at 5a1c8c7, loaded since 2f7d5f5) and the MTP head
    # (skipped by both)
    names |= vision_tensors(spec)
    names |= {"mtp.fc.weight": (hidden, 2 * hidden), "mtp.norm.weight": (hidden,),
              "mtp.layers.0.mlp.gate.weight": (experts, hidden)}
    return names


def _shapes(spec: dict[str, Any]) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """Each tensor's shape: the published names', or with `tensor_names` (a real index) those names exactly, each
    shaped as the published name it matches (per-expert tensors as one expert's slice); a name matching none is
    written as a vector of the hidden size and listed, so a loader that takes it shows a shape error and one that
    skips it shows in the load check."""
    published = hybrid_tensors(spec)
    if "tensor_names" not in spec:
        return published, []
    inter = spec["moe_intermediate_size"]
    shapes, unknown = {}, []
    for name in spec["tensor_names"]:
        expert = re.sub(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$", r".mlp.experts.\1", name)
        if name in published:
            shapes[name] = published[name]
        elif expert != name:
            hidden = spec["hidden_size"]
            shapes[name] = (hidden, inter) if expert.endswith("down") else (inter, hidden)
        else:
            shapes[name] = (spec["hidden_size"],)
            unknown.append(name)
    return shapes, unknown


def _hybrid_weights(spec: dict[str, Any], out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(spec["seed"])
    tensors = {}
    shapes, unknown = _shapes(spec)
    if unknown:
        print(f"[tiny-model] {len(unknown)} name(s) of the index match no published tensor, written as vectors: "
              f"{', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}", file=sys.stderr)
    for name, shape in shapes.items():
        value = torch.randn(shape, generator=gen)
        if name.endswith("linear_attn.norm.weight"):  # the gated norm multiplies by its weight
            value = 1 + 0.1 * value
        elif name.endswith("A_log"):
            value = 0.5 * value
        elif name.endswith("dt_bias"):
            value = 1 + 0.1 * value
        elif name.endswith("conv1d.weight"):
            value = value / shape[-1]
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):  # zero-centred: 1 + weight
            value = 0.1 * value
        else:
            value = 0.15 * value
        tensors[name] = value.to(getattr(torch, spec["dtype"])).contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def main(spec: dict[str, Any], out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    out.mkdir(parents=True)
    fast = _tokenizer(out)
    if spec.get("composite"):
        specials = {"bos_token_id": fast.convert_tokens_to_ids("<|endoftext|>"), "eos_token_id": fast.eos_token_id}
        config = _hybrid_config(spec, specials)
        config |= {key: fast.convert_tokens_to_ids(token) for key, token in VISION_TOKENS.items()}
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
        GenerationConfig(eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id).save_pretrained(out)
        _hybrid_weights(spec, out)
        return
    heads, head_dim = spec["num_attention_heads"], spec["head_dim"]
    config = AutoConfig.for_model(
        spec["model_type"], architectures=[spec["architecture"]], vocab_size=spec["vocab_size"],
        hidden_size=heads * head_dim, intermediate_size=2 * head_dim, num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=spec["num_key_value_heads"], head_dim=head_dim,
        max_position_embeddings=POSITIONS, torch_dtype=spec["dtype"], tie_word_embeddings=False, initializer_range=0.15,
        bos_token_id=fast.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=fast.eos_token_id)
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_config(config)
    if type(model).__name__ != spec["architecture"]:
        raise SystemExit(f"transformers builds {type(model).__name__} for {spec['model_type']}, "
                         f"not {spec['architecture']}")
    model.generation_config = GenerationConfig(eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    model.to(getattr(torch, spec["dtype"])).save_pretrained(out, safe_serialization=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), Path(sys.argv[2]))
