"""Run by the CPU runtime's Python with a patched vendor root first on sys.path (see test_preflight.py): the
patched vLLM attention functions, called with vLLM's own metadata and paged-cache layout, against dense attention.

The vendor's GPU libraries (ixformer, xformers) are the runtime's stand-ins (toolkit.runtime.standins, put on the path
by the test): importable, and a call raises naming the library and the caller, so a call that does not take the
native fast path says where it went. Prints one JSON object.
"""

import itertools
import json
import os
import sys

import torch


def dense(q, k, v, context_k=None, context_v=None):
    """Causal attention of one sequence over its context then itself, grouped KV, in float64."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if context_k is not None:
        k, v = torch.cat([context_k, k]), torch.cat([context_v, v])
    k = k.double().repeat_interleave(heads // kv_heads, dim=1)
    v = v.double().repeat_interleave(heads // kv_heads, dim=1)
    q = q.double()
    offset = k.shape[0] - q.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(offset + 1)
    weights = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


def sdpa_fallback(results):
    from vllm.attention.backends.abstract import AttentionType
    from vllm.attention.backends.xformers import XFormersImpl, XFormersMetadata

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, seq_lens = 16, 2, 256, [5, 9]
    tokens = sum(seq_lens)
    q = torch.randn(tokens, heads, dim, generator=gen)
    k, v = torch.randn(tokens, kv_heads, dim, generator=gen), torch.randn(tokens, kv_heads, dim, generator=gen)
    impl = XFormersImpl(heads, dim, dim ** -0.5, kv_heads, None, None, "auto")
    starts = torch.tensor([0, 5, 14], dtype=torch.int32)
    meta = XFormersMetadata(
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32), max_decode_seq_len=0, block_tables=None,
        num_prefills=2, num_prefill_tokens=tokens, num_decode_tokens=0, slot_mapping=torch.arange(tokens),
        max_prefill_seq_len=max(seq_lens), use_cuda_graph=False, seq_lens=seq_lens, seq_start_loc=starts,
        context_lens_tensor=torch.zeros(2, dtype=torch.int32), max_query_len=max(seq_lens),
        max_decode_query_len=0, query_start_loc=starts)
    want = torch.cat([dense(q[a:b], k[a:b], v[a:b]) for a, b in itertools.pairwise(starts)])
    for switch in ("1", "0"):
        os.environ["XFORMERS_SDPA_FALLBACK"] = switch
        try:
            got = impl._run_memory_efficient_xformers_forward(q, k, v, meta, AttentionType.DECODER)
            results[f"sdpa_fallback_{switch}"] = {"max_abs_diff": float((got.double() - want).abs().max())}
        except RuntimeError as exc:  # the stand-ins' StandInCalled
            results[f"sdpa_fallback_{switch}"] = {"error": str(exc), "type": type(exc).__name__}


def prefix(results):
    from vllm.attention.ops.paged_attn import PagedAttention

    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block = 8, 2, 128, 16
    contexts, queries = [20, 35], [4, 6]
    blocks = torch.tensor([[3, 0, 0], [1, 4, 2]], dtype=torch.int32)  # non-contiguous physical blocks
    cache = torch.zeros(PagedAttention.get_kv_cache_shape(6, block, kv_heads, dim))
    key_cache, value_cache = PagedAttention.split_kv_cache(cache, kv_heads, dim)
    x = key_cache.shape[-1]
    ctx_k = [torch.randn(n, kv_heads, dim, generator=gen) for n in contexts]
    ctx_v = [torch.randn(n, kv_heads, dim, generator=gen) for n in contexts]
    for b, n in enumerate(contexts):  # what reshape_and_cache writes, in vLLM's own cache views
        for t in range(n):
            physical, slot = int(blocks[b, t // block]), t % block
            key_cache[physical, :, :, slot, :] = ctx_k[b][t].view(kv_heads, dim // x, x)
            value_cache[physical, :, :, slot] = ctx_v[b][t]
    tokens = sum(queries)
    q = torch.randn(tokens, heads, dim, generator=gen)
    k, v = torch.randn(tokens, kv_heads, dim, generator=gen), torch.randn(tokens, kv_heads, dim, generator=gen)
    starts = torch.tensor([0, 4, 10], dtype=torch.int32)
    os.environ["PREFIX_FLASH"] = "1"
    got = PagedAttention.forward_prefix(
        q, k, v, "auto", key_cache, value_cache, blocks, starts,
        torch.tensor([c + n for c, n in zip(contexts, queries, strict=True)], dtype=torch.int32),
        torch.tensor(contexts, dtype=torch.int32), max(queries), None, None, 1.0, 1.0)
    want = torch.cat([dense(q[a:b], k[a:b], v[a:b], ctx_k[i], ctx_v[i])
                      for i, (a, b) in enumerate(itertools.pairwise(starts))])
    results["prefix"] = {"max_abs_diff": float((got.double() - want).abs().max())}


def main():
    results = {}
    sdpa_fallback(results)
    prefix(results)
    json.dump(results, sys.__stdout__)


if __name__ == "__main__":
    sys.stdout = sys.stderr
    main()
