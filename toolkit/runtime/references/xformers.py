"""CPU references for the image's `xformers`: what vLLM 0.6.3's Qwen2-VL vision attention
calls on the image (`vllm/model_executor/models/qwen2_vl.py`, the non-CPU branch), which the adapter's vision tower
uses since 2f7d5f5: non-causal attention inside each image's patches, none across images."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F


class BlockDiagonalMask:
    """Full attention inside each of the concatenated sequences, none across them (ixformer's causal mask is this
    one, causal inside each)."""

    def __init__(self, q_seqlens: Sequence[int], kv_seqlens: Sequence[int] | None = None) -> None:
        self.q_seqlens = [int(n) for n in q_seqlens]
        self.kv_seqlens = [int(n) for n in (kv_seqlens if kv_seqlens is not None else q_seqlens)]

    @classmethod
    def from_seqlens(cls, q_seqlen: Sequence[int], kv_seqlen: Sequence[int] | None = None) -> BlockDiagonalMask:
        return cls(q_seqlen, kv_seqlen)


def memory_efficient_attention_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                       attn_bias: BlockDiagonalMask | None = None, p: float = 0.0,
                                       scale: float | None = None, op: Any = None) -> torch.Tensor:
    """query, key, value `[1, tokens, heads, d]`; block-diagonal, not causal, over the sequences of attn_bias."""
    if p != 0.0:
        raise NotImplementedError("the xformers reference computes no attention dropout (p=0.0 at inference)")
    if query.shape[0] != 1:
        raise NotImplementedError("the xformers reference takes one concatenated batch row (vLLM's layout)")
    q = query[0].to(torch.float32).transpose(0, 1)
    k = key[0].to(torch.float32).transpose(0, 1)
    v = value[0].to(torch.float32).transpose(0, 1)
    lengths = attn_bias.q_seqlens if attn_bias is not None else [q.shape[1]]
    kv_lengths = attn_bias.kv_seqlens if attn_bias is not None else [k.shape[1]]
    pieces, q_start, kv_start = [], 0, 0
    for q_len, kv_len in zip(lengths, kv_lengths, strict=True):
        pieces.append(F.scaled_dot_product_attention(q[:, q_start:q_start + q_len], k[:, kv_start:kv_start + kv_len],
                                                     v[:, kv_start:kv_start + kv_len], scale=scale))
        q_start, kv_start = q_start + q_len, kv_start + kv_len
    return torch.cat(pieces, dim=1).transpose(0, 1).unsqueeze(0).to(query.dtype)


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "xformers.ops.memory_efficient_attention_forward": memory_efficient_attention_forward,
    "xformers.ops.fmha.attn_bias.BlockDiagonalMask.from_seqlens": BlockDiagonalMask.from_seqlens,
}
