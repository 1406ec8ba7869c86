"""A tiny checkpoint of the recipe's model architecture, for running the served path on a CPU.

What the served code depends on is kept: the architecture and model_type, the head size, the ratio of query to KV
heads, the served dtype, the tensor names of the published checkpoint (transformers writes them: the names a
loader's `load_weights` maps), the family's special tokens; everything else is shrunk (4 layers, a vocabulary of a
few hundred). The KV heads are the tensor-parallel size, so every rank holds whole heads. Seeded: the same spec
gives the same bytes. Built by the CPU runtime's Python (run as a script), cached by the spec's content hash,
written to a temporary folder and renamed into place.

Not yet: the composite hybrid configs (Qwen3.5/3.6: text_config, linear attention, experts, the MTP and vision
tensors the loader skips); `tiny_spec` refuses them and says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] if m['content'] is string else '' }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LAYERS = 4
VOCAB = 384
SEED = 0


def tiny_spec(model: Any, tp: int) -> dict[str, Any]:
    """The tiny model's spec from the recipe's `model:` (a ModelShape) at tensor-parallel size `tp`."""
    from toolkit.errors import ToolkitError

    if model.architecture is None or model.model_type is None:
        raise ToolkitError("a tiny model needs the served model's architecture and model_type",
                           hint="set model.architecture and model.model_type in the recipe")
    if model.text_config or model.linear_attention is not None:
        raise ToolkitError(f"no tiny checkpoint for {model.architecture} yet: its composite config (text_config, "
                           "linear attention, experts) is not built here",
                           hint="the served path runs on a CPU for single-config attention models (Qwen2 family)")
    heads = model.num_attention_heads or model.hidden_size // model.head_dim
    if heads % model.num_kv_heads:
        raise ToolkitError(f"{heads} query heads do not split over {model.num_kv_heads} KV heads")
    ratio = heads // model.num_kv_heads
    return {"architecture": model.architecture, "model_type": model.model_type, "dtype": model.dtype,
            "head_dim": model.head_dim, "num_key_value_heads": tp, "num_attention_heads": ratio * tp,
            "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "seed": SEED}


def build(spec: dict[str, Any], python: Path, cache: Path) -> Path:
    """The checkpoint folder for `spec` under `cache`, built once by `python` (the CPU runtime)."""
    from toolkit.errors import ToolkitError
    from toolkit.pyenv import build_key, script

    target = cache / f"tiny-{spec['model_type']}-{build_key(json.dumps(spec, sort_keys=True), files=[Path(__file__)])}"
    if (target / "config.json").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    partial = cache / f"{target.name}.partial-{os.getpid()}"
    print(f"[tiny-model] building {spec['architecture']} ({spec['num_hidden_layers']} layers, "
          f"{spec['num_attention_heads']}:{spec['num_key_value_heads']} heads of {spec['head_dim']}) in {target}",
          file=sys.stderr)
    proc = subprocess.run(script(python, Path(__file__), json.dumps(spec), str(partial)), capture_output=True,
                          text=True)
    if proc.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)  # ours: made by this call
        raise ToolkitError(f"building the tiny {spec['architecture']} failed:\n{proc.stderr[-3000:]}")
    try:
        partial.rename(target)
    except OSError:  # another build finished first: its folder is the same bytes
        shutil.rmtree(partial, ignore_errors=True)
    return target


# -- run in the CPU runtime -------------------------------------------------------------------------------------

CORPUS = ("the model serves tokens on a card ; every request streams its answer , and the cache keeps blocks of "
          "keys and values for prefixes that repeat . tools are called with arguments in json")


def _corpus() -> list[str]:
    words = CORPUS.split()
    return [" ".join(words[i:] + words[:i]) for i in range(len(words))]


def _tokenizer(out: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS[3:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def main(spec: dict[str, Any], out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    out.mkdir(parents=True)
    fast = _tokenizer(out)
    heads, head_dim = spec["num_attention_heads"], spec["head_dim"]
    config = AutoConfig.for_model(
        spec["model_type"], architectures=[spec["architecture"]], vocab_size=spec["vocab_size"],
        hidden_size=heads * head_dim, intermediate_size=2 * head_dim, num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=spec["num_key_value_heads"], head_dim=head_dim,
        max_position_embeddings=4096, torch_dtype=spec["dtype"], tie_word_embeddings=False, initializer_range=0.15,
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
