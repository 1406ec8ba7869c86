"""`layers_block_type` for the model adapter's Qwen3.5/3.6 config classes: what vLLM 0.6.3 counts when it sizes the
KV cache.

Deployed into transformers (`transformers/hybrid_kv_accounting.py`) and set as a class attribute of the adapter's
four config classes by the recipe. vLLM 0.6.3's `ModelConfig.get_num_attention_layers` counts the entries of
`hf_config.layers_block_type` equal to "attention", and every layer when the config has no such attribute; the
vendor's `CacheEngine` allocates one KV cache per counted layer. The adapter's model reads only
`kv_caches[attn_idx]`, `attn_idx` counting its full-attention layers (10 of 40), and keeps its GatedDeltaNet
layers' state in the mamba cache: counted as 40, 30 of the caches are never touched.

HYBRID_KV_ACCOUNTING, read each time vLLM asks:
- `full_attention` (the default): "attention" for the `layer_types` entries that are "full_attention",
  "linear_attention" for the others (10 KV caches for Qwen3.6-35B-A3B);
- `legacy40`: "attention" for every layer (what vLLM counts without the attribute: 40).
Anything else raises. Pure Python, no vLLM import: it runs wherever transformers loads the config.
"""

from __future__ import annotations

import os
from typing import Any

SWITCH = "HYBRID_KV_ACCOUNTING"
DEFAULT = "full_attention"
MODES = ("full_attention", "legacy40")


def mode() -> str:
    value = os.environ.get(SWITCH, DEFAULT)
    if value not in MODES:
        raise ValueError(f"{SWITCH}={value!r}: expected one of {', '.join(MODES)}")
    return value


def _layer_types(config: Any) -> list[str]:
    """The text model's layer types (a composite config keeps them in its text_config)."""
    text = getattr(config, "text_config", None)
    source = text if text is not None and text is not config else config
    types = getattr(source, "layer_types", None)
    if types is None:  # configs that only say the interval (layer i is full attention when (i + 1) % n == 0)
        interval = int(getattr(source, "full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(int(source.num_hidden_layers))]
    return [str(t) for t in types]


def _get(config: Any) -> list[str]:
    types = _layer_types(config)
    if mode() == "legacy40":
        return ["attention"] * len(types)
    return ["attention" if t == "full_attention" else "linear_attention" for t in types]


def _set(config: Any, value: Any) -> None:
    """A config.json that serializes the attribute must say what the switch computes: a stale value would size
    the KV cache for the other accounting without a word."""
    if list(value) != _get(config):
        raise ValueError(f"layers_block_type in the config ({list(value).count('attention')} attention layers) "
                         f"differs from {SWITCH}={mode()} ({_get(config).count('attention')}): drop it from "
                         "config.json or set the switch to match")


layers_block_type = property(_get, _set, doc="What vLLM 0.6.3 counts as attention layers (HYBRID_KV_ACCOUNTING)")
