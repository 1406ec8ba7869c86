"""Attention fallbacks for the xFormers backend of vLLM 0.6.3 on CoreX.

The vendor's ixformer flash op is wrong for head_dim > 128 (Qwen3.6 full attention uses 256),
so prefill for those heads goes through torch's scaled_dot_product_attention instead.
Only APIs present in torch 2.1 are used.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def sdpa_varlen_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_lens: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention over prompts packed along dim 0.

    query: [tokens, heads, head_dim]; key/value: [tokens, kv_heads, head_dim] with heads a
    multiple of kv_heads (grouped KV: query head h reads KV head h // (heads // kv_heads)).
    Returns [tokens, heads, head_dim], matching the packed layout vLLM's prefill path returns.
    """
    tokens, heads, _ = query.shape
    kv_heads = key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    if sum(seq_lens) != tokens:
        raise ValueError(f"seq_lens sum to {sum(seq_lens)} but {tokens} tokens were given")
    group = heads // kv_heads
    out = torch.empty_like(query)
    start = 0
    for length in seq_lens:
        end = start + int(length)
        q = query[start:end].transpose(0, 1)  # [heads, L, D]
        k = key[start:end].transpose(0, 1)
        v = value[start:end].transpose(0, 1)
        if group > 1:
            k = k.repeat_interleave(group, dim=0)
            v = v.repeat_interleave(group, dim=0)
        o = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                           is_causal=True, scale=scale)
        out[start:end] = o.squeeze(0).transpose(0, 1)
        start = end
    return out
