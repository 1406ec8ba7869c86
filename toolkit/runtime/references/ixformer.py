"""ixformer (CoreX 3.2.3, ixformer 0.4.0) as the vendor's vLLM calls it on the serving path (DESIGN.md section 3,
"More vendor edits on the serving path"), computed with plain torch on CPU tensors.

Argument orders and in-place results are the vendor's: `silu_and_mul(x, out)` writes `out`; `rms_norm(input,
weight, out, epsilon)` writes `out`; `fused_add_rms_norm` writes `input` (normalised) and `residual` (the sum);
`vllm_rotary_embedding_neox` rotates `query` and `key` in place; the cache ops write the paged caches in vLLM
0.6.3's layout (key `[blocks, kv_heads, head_size // x, block_size, x]`, value `[blocks, kv_heads, head_size,
block_size]`). Norms and softmaxes are computed in float32 and cast back, as vLLM's own `forward_native` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .xformers import BlockDiagonalMask

# -- activations ------------------------------------------------------------------------------------------------


def _gated(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def gated(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        out.copy_(act(x[..., :d]) * x[..., d:])
        return out

    return gated


silu_and_mul = _gated(F.silu)
gelu_and_mul = _gated(lambda t: F.gelu(t, approximate="none"))
gelu_tanh_and_mul = _gated(lambda t: F.gelu(t, approximate="tanh"))


# -- norms ------------------------------------------------------------------------------------------------------

def _normed(x32: torch.Tensor, weight: torch.Tensor, epsilon: float, dtype: torch.dtype) -> torch.Tensor:
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    return (x32 * torch.rsqrt(variance + epsilon)).to(dtype) * weight


def rms_norm(input: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, epsilon: float) -> torch.Tensor:
    out.copy_(_normed(input.to(torch.float32), weight, epsilon, input.dtype))
    return out


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       epsilon: float) -> None:
    summed = input.to(torch.float32) + residual.to(torch.float32)
    residual.copy_(summed.to(residual.dtype))
    input.copy_(_normed(residual.to(torch.float32), weight, epsilon, input.dtype))


# -- rotary embedding -------------------------------------------------------------------------------------------

def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    if neox:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def vllm_rotary_embedding_neox(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
                               cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache.index_select(0, positions.flatten()).chunk(2, dim=-1)
    for tensor in (query, key):
        view = tensor.view(positions.numel(), -1, head_size)
        view[..., :rotary_dim] = _rotate(view[..., :rotary_dim].clone(), cos, sin, is_neox)


# -- the paged KV cache -----------------------------------------------------------------------------------------

def vllm_cache_ops_reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                                     value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    block_size = value_cache.shape[-1]
    x = key_cache.shape[-1]
    slots = slot_mapping.flatten().to(torch.int64)
    keep = slots >= 0  # a padding token has slot -1 and is not written
    slots, key, value = slots[keep], key[keep], value[keep]
    blocks, offsets = slots // block_size, slots % block_size
    tokens, kv_heads, head_size = key.shape
    key_cache[blocks, :, :, offsets, :] = key.reshape(tokens, kv_heads, head_size // x, x).to(key_cache.dtype)
    value_cache[blocks, :, :, offsets] = value.to(value_cache.dtype)


def _gathered(key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor, length: int,
              block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `length` positions of one sequence's keys and values: `[length, kv_heads, head_size]`."""
    positions = torch.arange(length)
    blocks = table.to(torch.int64)[positions // block_size]
    offsets = positions % block_size
    keys = key_cache[blocks, :, :, offsets, :]  # [length, kv_heads, head_size // x, x]
    values = value_cache[blocks, :, :, offsets]  # [length, kv_heads, head_size]
    return keys.flatten(-2), values


def vllm_single_query_cached_kv_attention(output: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                                          value_cache: torch.Tensor, head_mapping: torch.Tensor, scale: float,
                                          block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                                          max_context_len: int, alibi_slopes: torch.Tensor | None = None) -> None:
    """One query token per sequence against its cached context; query head h reads KV head head_mapping[h]."""
    if alibi_slopes is not None:
        raise NotImplementedError("the ixformer reference computes no ALiBi (the served models use RoPE)")
    mapping = head_mapping.to(torch.int64)
    heads = torch.arange(query.shape[1])
    for seq in range(query.shape[0]):
        length = int(context_lens[seq])
        keys, values = _gathered(key_cache, value_cache, block_tables[seq], length, block_size)
        keys, values = keys.to(torch.float32), values.to(torch.float32)  # [len, kv_heads, d]
        q = query[seq].to(torch.float32)  # [heads, d]
        # every query head against every KV head (a handful), then the pair head_mapping names: the context is
        # not copied once per query head
        scores = torch.einsum("hd,lkd->hkl", q, keys)[heads, mapping] * scale  # [heads, len]
        weighted = torch.einsum("hl,lkd->hkd", scores.softmax(dim=-1), values)  # [heads, kv_heads, d]
        output[seq] = weighted[heads, mapping].to(output.dtype)


def copy_blocks(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    pairs = block_mapping.to(torch.int64).view(-1, 2)
    for cache in (*key_caches, *value_caches):
        cache[pairs[:, 1]] = cache[pairs[:, 0]]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    pairs = block_mapping.to(torch.int64).view(-1, 2)
    dst[pairs[:, 1].to(dst.device)] = src[pairs[:, 0].to(src.device)].to(dst.device)


# -- linear layers ----------------------------------------------------------------------------------------------

def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(input, weight, bias)


# -- the xformers backend's prefill ------------------------------------------------------------------------------

class BlockDiagonalCausalMask(BlockDiagonalMask):
    """Causal attention inside each of the concatenated sequences, none across them (xformers' mask, built by
    `from_seqlens`)."""

    def make_local_attention(self, window_size: int) -> Any:
        raise NotImplementedError("the ixformer reference has no sliding-window mask (no served model uses one)")


FLASH_HEAD_DIM = 128  # the largest head size ixformer's flash op computes right


class FlashHeadDimError(RuntimeError):
    """The vendor's prefill op was asked for a head size it computes wrong on the image."""


class FwOp:
    """ixformer's flash forward op: which kernel runs; the reference computes the same attention."""


def memory_efficient_attention_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                       attn_bias: BlockDiagonalCausalMask | None = None, p: float = 0.0,
                                       scale: float | None = None, op: Any = None) -> torch.Tensor:
    """query `[1, tokens, heads, d]`, key and value `[1, tokens, kv_heads, d]` (the vendor drops the GQA expansion:
    query head h reads KV head h // (heads // kv_heads)); block-diagonal causal over the sequences of attn_bias."""
    if p != 0.0:
        raise NotImplementedError("the ixformer reference computes no attention dropout (p=0.0 at inference)")
    if query.shape[-1] > FLASH_HEAD_DIM:
        # computing the right answer here would hide what the image does: its flash op is wrong above 128
        raise FlashHeadDimError(
            f"ixformer's flash forward op is wrong for head_dim {query.shape[-1]} > {FLASH_HEAD_DIM} on the image "
            "(DESIGN.md section 3): this prefill must take the SDPA fallback (XFORMERS_SDPA_FALLBACK=1)")
    heads, kv_heads = query.shape[2], key.shape[2]
    group = heads // kv_heads
    q = query[0].to(torch.float32).transpose(0, 1)  # [heads, tokens, d]
    k = key[0].to(torch.float32).transpose(0, 1).repeat_interleave(group, dim=0)
    v = value[0].to(torch.float32).transpose(0, 1).repeat_interleave(group, dim=0)
    lengths = attn_bias.q_seqlens if attn_bias is not None else [q.shape[1]]
    kv_lengths = attn_bias.kv_seqlens if attn_bias is not None else [k.shape[1]]
    pieces, q_start, kv_start = [], 0, 0
    for q_len, kv_len in zip(lengths, kv_lengths, strict=True):
        piece = F.scaled_dot_product_attention(
            q[:, q_start:q_start + q_len], k[:, kv_start:kv_start + kv_len], v[:, kv_start:kv_start + kv_len],
            is_causal=attn_bias is not None, scale=scale)
        pieces.append(piece)
        q_start, kv_start = q_start + q_len, kv_start + kv_len
    return torch.cat(pieces, dim=1).transpose(0, 1).unsqueeze(0).to(query.dtype)


# -- tensor parallelism -----------------------------------------------------------------------------------------

def all_reduce(input_: torch.Tensor, group: Any = None, async_op: bool = False) -> None:
    """The TP all-reduce, in place, on the torch.distributed group it was made from (gloo on a CPU). The image does
    not wait on it (async_op=True); here it is done when this returns, which is the same tensor afterwards."""
    import torch.distributed as dist

    dist.all_reduce(input_, group=group)


def create_ixformer_group_from_pg(process_group: Any) -> Any:
    return process_group


XOPS = "ixformer.contrib.xformers.ops"
FUNCTIONS: dict[str, Callable[..., Any]] = {
    **{f"ixformer.functions.{f.__name__}": f for f in (
        rms_norm, fused_add_rms_norm, vllm_rotary_embedding_neox, vllm_cache_ops_reshape_and_cache,
        vllm_single_query_cached_kv_attention, copy_blocks, swap_blocks, linear)},
    "ixformer.functions.silu_and_mul": silu_and_mul,
    "ixformer.functions.gelu_and_mul": gelu_and_mul,
    "ixformer.functions.gelu_tanh_and_mul": gelu_tanh_and_mul,
    f"{XOPS}.memory_efficient_attention_forward": memory_efficient_attention_forward,
    f"{XOPS}.fmha.flash.FwOp": FwOp,
    f"{XOPS}.fmha.attn_bias.BlockDiagonalCausalMask.from_seqlens": BlockDiagonalCausalMask.from_seqlens,
    "ixformer.distributed.all_reduce": all_reduce,
    "ixformer.contrib.torch.extension.ixformer_torch.distributed.create_ixformer_group_from_pg":
        create_ixformer_group_from_pg,
}
