"""Prefix attention over vLLM 0.6.3's paged KV cache, tiled so memory stays bounded at 245K tokens.

Cache layout (vllm/attention/ops/paged_attn.py, split_kv_cache):
    key_cache   (num_blocks, kv_heads, head_size // x, block_size, x), x = 16 // element_size
    value_cache (num_blocks, kv_heads, head_size, block_size)
For sequence b, its first context_lens[b] tokens live in the blocks block_tables[b]; its new tokens
are query[query_start_loc[b]:query_start_loc[b + 1]] with their keys and values in `key`/`value`,
causal among themselves. Context is read `tile` tokens at a time with an online softmax.
"""

from __future__ import annotations

import torch

from native_fastpaths.profiling import profiled


def gather_context(key_cache: torch.Tensor, value_cache: torch.Tensor, blocks: torch.Tensor, start: int,
                   end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of context tokens [start, end) of one sequence: (kv_heads, n, head_size) each."""
    block_size = value_cache.shape[-1]
    first, last = start // block_size, (end - 1) // block_size + 1
    ids = blocks[first:last].long()
    k = key_cache[ids]  # (nb, Hkv, D/x, bs, x)
    k = k.permute(1, 0, 3, 2, 4).reshape(k.shape[1], -1, k.shape[2] * k.shape[4])  # (Hkv, nb*bs, D)
    v = value_cache[ids].permute(1, 0, 3, 2).reshape(value_cache.shape[1], -1, value_cache.shape[2])
    offset = start - first * block_size
    return k[:, offset:offset + end - start], v[:, offset:offset + end - start]


def _merge(acc: torch.Tensor, m: torch.Tensor, s: torch.Tensor, scores: torch.Tensor, v: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one tile of scores (Hkv, rows, n) and values (Hkv, n, D) into a running softmax."""
    m_new = torch.maximum(m, scores.amax(-1))
    correction = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[..., None])
    return acc * correction[..., None] + p @ v, m_new, s * correction + p.sum(-1)


def prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, tile: int = 4096) -> torch.Tensor:
    """query (Tq, H, D); key/value (Tq, Hkv, D). Returns (Tq, H, D) in the query's dtype.

    The `group` query heads that read one KV head (head h reads KV head h // group) are stacked as one (group * L)
    matrix against it, so no KV tile is copied per query head."""
    with profiled("attention.prefix", query.device):
        heads, kv_heads = query.shape[1], key.shape[1]
        group = heads // kv_heads
        out = torch.empty_like(query)
        starts = query_start_loc.tolist()
        contexts = context_lens.tolist()
        for b in range(len(starts) - 1):
            lo, hi = starts[b], starts[b + 1]
            if hi == lo:
                continue
            length = hi - lo
            rows = group * length
            q = (query[lo:hi].transpose(0, 1).float() * scale).reshape(kv_heads, rows, -1)  # (Hkv, group*L, D)
            acc = torch.zeros(kv_heads, rows, value.shape[-1], dtype=torch.float32, device=query.device)
            m = torch.full((kv_heads, rows), float("-inf"), dtype=torch.float32, device=query.device)
            s = torch.zeros(kv_heads, rows, dtype=torch.float32, device=query.device)
            for t0 in range(0, int(contexts[b]), tile):
                t1 = min(t0 + tile, int(contexts[b]))
                k, v = gather_context(key_cache, value_cache, block_tables[b], t0, t1)
                k, v = k.float(), v.float()
                acc, m, s = _merge(acc, m, s, q @ k.transpose(-1, -2), v)
            k_new = key[lo:hi].transpose(0, 1).float()  # (Hkv, L, D)
            v_new = value[lo:hi].transpose(0, 1).float()
            scores = q @ k_new.transpose(-1, -2)  # (Hkv, group*L, L): row r is query token r % L
            causal = torch.ones(length, length, dtype=torch.bool, device=query.device).triu(1).repeat(group, 1)
            acc, m, s = _merge(acc, m, s, scores.masked_fill(causal, float("-inf")), v_new)
            out[lo:hi] = (acc / s[..., None]).reshape(heads, length, -1).transpose(0, 1).to(query.dtype)
        return out


def forward_prefix(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache_dtype: str,
                   key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                   query_start_loc: torch.Tensor, seq_lens_tensor: torch.Tensor, context_lens: torch.Tensor,
                   max_query_len: int, alibi_slopes: torch.Tensor | None, sliding_window: int | None,
                   k_scale: float, v_scale: float) -> torch.Tensor:
    """Drop-in for PagedAttention.forward_prefix of vLLM 0.6.3 (no alibi, no sliding window, no fp8 cache)."""
    if alibi_slopes is not None or sliding_window not in (None, 0, -1) or kv_cache_dtype not in ("auto", None):
        raise NotImplementedError("native prefix attention covers no alibi, no sliding window, auto cache dtype")
    return prefix_attention(query, key, value, key_cache, value_cache, block_tables, query_start_loc,
                            context_lens, query.shape[-1] ** -0.5)
