"""The CPU references of the vendor's GPU library (toolkit/runtime/references), each against an independent
computation in float64: element loops over the paged cache in its layout, per-head softmax loops, explicit
formulas; with the edges (a context that ends mid-block, blocks out of order, GQA 16:2, head size 256, bf16 and
fp32). Part of the issue "the served path runs on a CPU": the references alone, before the served path uses them."""

from __future__ import annotations

import math
import re

import pytest
from pinned_adapter import NEWEST_FILES, require

torch = pytest.importorskip("torch", reason="the references are plain torch: pip install torch==2.13.0")

from toolkit.runtime.references import REFERENCES, ixformer, reference  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,act", [("silu_and_mul", lambda t: t / (1 + torch.exp(-t))),
                                      ("gelu_and_mul", lambda t: 0.5 * t * (1 + torch.erf(t / math.sqrt(2)))),
                                      ("gelu_tanh_and_mul", lambda t: 0.5 * t * (1 + torch.tanh(
                                          math.sqrt(2 / math.pi) * (t + 0.044715 * t ** 3))))])
def test_gated_activations_write_out(name: str, act, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(7, 2 * 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = torch.full((7, 48), float("nan"), dtype=dtype)
    reference(f"ixformer.functions.{name}")(x, out)  # the vendor's order: (x, out)
    x64 = x.double()
    _close(out, act(x64[:, :48]) * x64[:, 48:], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norms_in_place(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    x, res, w = (torch.randn(5, 256, generator=g).to(dtype) for _ in range(3))

    def rows(t: torch.Tensor) -> torch.Tensor:
        return torch.stack([r / math.sqrt(float((r * r).mean()) + 1e-6) for r in t.double()]) * w.double()

    out = torch.empty_like(x)
    ixformer.rms_norm(x, w, out, 1e-6)  # (input, weight, out, epsilon)
    _close(out, rows(x), dtype)
    summed = x.double() + res.double()
    a, b = x.clone(), res.clone()
    ixformer.fused_add_rms_norm(a, b, w, 1e-6)  # input <- norm(input + residual), residual <- the sum
    _close(b, summed, dtype)
    _close(a, rows(b), dtype)


@pytest.mark.parametrize("neox", [True, False])
def test_rotary_embedding_rotates_query_and_key_in_place(neox: bool) -> None:
    g = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, head_size, rotary = 6, 4, 2, 64, 32  # partial rotary: the tail passes through
    base = 10000.0
    inv = 1.0 / base ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
    angles = torch.arange(128, dtype=torch.float64)[:, None] * inv[None]
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1).float()
    positions = torch.tensor([0, 5, 9, 17, 3, 127])
    q = torch.randn(tokens, heads * head_size, generator=g)
    k = torch.randn(tokens, kv_heads * head_size, generator=g)
    q0, k0 = q.clone(), k.clone()
    ixformer.vllm_rotary_embedding_neox(positions, q, k, head_size, cache, neox)
    for got, before, n in ((q, q0, heads), (k, k0, kv_heads)):
        for t in range(tokens):
            for h in range(n):
                vec = before[t].view(n, head_size)[h].double()
                want = vec.clone()
                for i in range(rotary // 2):
                    a, b = (i, i + rotary // 2) if neox else (2 * i, 2 * i + 1)
                    z = complex(vec[a], vec[b]) * complex(math.cos(angles[positions[t], i]),
                                                          math.sin(angles[positions[t], i]))
                    want[a], want[b] = z.real, z.imag
                torch.testing.assert_close(got[t].view(n, head_size)[h].double(), want, atol=1e-5, rtol=1e-5)


def _paged(dtype: torch.dtype, blocks: int, kv_heads: int, head_size: int, block_size: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Caches in vLLM 0.6.3's layout (PagedAttention.split_kv_cache), filled with NaN: what is read unwritten shows."""
    x = 16 // torch.tensor([], dtype=dtype).element_size()
    key = torch.full((blocks, kv_heads, head_size // x, block_size, x), float("nan"), dtype=dtype)
    value = torch.full((blocks, kv_heads, head_size, block_size), float("nan"), dtype=dtype)
    return key, value


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_size", [(16, 2, 256), (4, 4, 128)])
def test_cache_write_and_decode_attention_over_the_paged_cache(dtype: torch.dtype, heads: int, kv_heads: int,
                                                               head_size: int) -> None:
    g = torch.Generator().manual_seed(4)
    block_size, blocks = 16, 12
    tables = torch.tensor([[7, 2, 9, 0], [11, 4, 0, 0], [3, 0, 0, 0]], dtype=torch.int32)  # out of order
    lengths = [50, 17, 16]  # mid-block, one past a block, exactly one block
    key_cache, value_cache = _paged(dtype, blocks, kv_heads, head_size, block_size)
    x = key_cache.shape[-1]
    keys = [torch.randn(n, kv_heads, head_size, generator=g).to(dtype) for n in lengths]
    values = [torch.randn(n, kv_heads, head_size, generator=g).to(dtype) for n in lengths]
    slots = torch.cat([torch.tensor([int(tables[s, p // block_size]) * block_size + p % block_size
                                     for p in range(n)]) for s, n in enumerate(lengths)])
    padded = torch.cat([slots, torch.tensor([-1])])  # a padding token: not written
    ixformer.vllm_cache_ops_reshape_and_cache(torch.cat([*keys, keys[0][:1]]), torch.cat([*values, values[0][:1]]),
                                              key_cache, value_cache, padded.to(torch.int32))
    for s, n in enumerate(lengths):  # each element where the layout says it is
        for p in range(n):
            block, off = int(tables[s, p // block_size]), p % block_size
            for h in range(kv_heads):
                for d in (0, x - 1, x, head_size - 1):
                    assert key_cache[block, h, d // x, off, d % x] == keys[s][p, h, d]
                    assert value_cache[block, h, d, off] == values[s][p, h, d]
    query = torch.randn(3, heads, head_size, generator=g).to(dtype)
    mapping = torch.repeat_interleave(torch.arange(kv_heads, dtype=torch.int32), heads // kv_heads)
    out = torch.full_like(query, float("nan"))
    scale = head_size ** -0.5
    ixformer.vllm_single_query_cached_kv_attention(out, query, key_cache, value_cache, mapping, scale, tables,
                                                   torch.tensor(lengths, dtype=torch.int32), block_size, max(lengths))
    for s, n in enumerate(lengths):
        for h in range(heads):
            kv = h // (heads // kv_heads)
            scores = [float(query[s, h].double() @ keys[s][p, kv].double()) * scale for p in range(n)]
            top = max(scores)
            weights = [math.exp(v - top) for v in scores]
            want = sum(w * values[s][p, kv].double() for p, w in enumerate(weights)) / sum(weights)
            torch.testing.assert_close(out[s, h].double(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_a_head_mapping_ignored_is_seen() -> None:
    """The mutant the generation test will also catch: KV head = query head // 1 reads the wrong heads."""
    g = torch.Generator().manual_seed(5)
    key_cache, value_cache = _paged(torch.float32, 2, 2, 32, 16)
    k, v = torch.randn(10, 2, 32, generator=g), torch.randn(10, 2, 32, generator=g)
    ixformer.vllm_cache_ops_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(10))
    query, tables, lengths = torch.randn(1, 4, 32, generator=g), torch.tensor([[0, 1]]), torch.tensor([10])
    right, wrong = torch.empty_like(query), torch.empty_like(query)
    ixformer.vllm_single_query_cached_kv_attention(right, query, key_cache, value_cache,
                                                   torch.tensor([0, 0, 1, 1]), 0.2, tables, lengths, 16, 10)
    ixformer.vllm_single_query_cached_kv_attention(wrong, query, key_cache, value_cache,
                                                   torch.tensor([0, 1, 0, 1]), 0.2, tables, lengths, 16, 10)
    assert not torch.allclose(right[0, 1], wrong[0, 1]) and torch.allclose(right[0, 0], wrong[0, 0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_is_block_diagonal_causal_with_gqa(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(6)
    heads, kv_heads, head_size, lengths = 16, 2, 128, [5, 1, 9]
    tokens = sum(lengths)
    q = torch.randn(1, tokens, heads, head_size, generator=g).to(dtype)
    k = torch.randn(1, tokens, kv_heads, head_size, generator=g).to(dtype)
    v = torch.randn(1, tokens, kv_heads, head_size, generator=g).to(dtype)
    mask = REFERENCES["ixformer.contrib.xformers.ops.fmha.attn_bias.BlockDiagonalCausalMask.from_seqlens"](lengths)
    op = REFERENCES["ixformer.contrib.xformers.ops.fmha.flash.FwOp"]()
    out = ixformer.memory_efficient_attention_forward(q, k, v, attn_bias=mask, p=0.0, scale=0.1, op=op)
    assert out.shape == q.shape
    start = 0
    for n in lengths:
        for t in range(n):
            for h in range(heads):
                kv = h // (heads // kv_heads)
                scores = torch.stack([q[0, start + t, h].double() @ k[0, start + j, kv].double() * 0.1
                                      for j in range(t + 1)])  # causal, inside its own sequence only
                want = scores.softmax(0) @ v[0, start:start + t + 1, kv].double()
                torch.testing.assert_close(out[0, start + t, h].double(), want, atol=TOL[dtype], rtol=TOL[dtype])
        start += n


def test_the_flash_op_refuses_the_head_size_it_computes_wrong_on_the_image() -> None:
    q = torch.zeros(1, 3, 2, 256)
    with pytest.raises(ixformer.FlashHeadDimError, match="head_dim 256 > 128 on the image"):
        ixformer.memory_efficient_attention_forward(q, q, q, ixformer.BlockDiagonalCausalMask.from_seqlens([3]))


def test_block_copies_and_swaps() -> None:
    a = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)
    b = a.clone() * 10
    ixformer.copy_blocks([a], [b], torch.tensor([[0, 4], [2, 1]]))
    assert a[4].tolist() == a[0].tolist() and a[1].tolist() == [6.0, 7.0, 8.0] and b[4].tolist() == b[0].tolist()
    dst = torch.zeros(5, 3)
    ixformer.swap_blocks(a, dst, torch.tensor([[3, 0]]))
    assert dst[0].tolist() == a[3].tolist() and dst[1:].abs().sum() == 0


def test_the_all_reduce_runs_on_the_torch_group(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        group = ixformer.create_ixformer_group_from_pg(dist.group.WORLD)
        t = torch.tensor([1.0, 2.0])
        assert ixformer.all_reduce(t, group=group, async_op=True) is None and t.tolist() == [1.0, 2.0]
    finally:
        dist.destroy_process_group()


def test_the_registry_names_what_the_vendor_calls_and_nothing_else() -> None:
    assert reference("ixformer.functions.moe_align_block_size") is None  # no reference: the stand-in raises
    assert {n.rsplit(".", 1)[-1] for n in REFERENCES} >= {
        "silu_and_mul", "vllm_single_query_cached_kv_attention", "vllm_rotary_embedding_neox", "rms_norm",
        "fused_add_rms_norm", "vllm_cache_ops_reshape_and_cache", "copy_blocks", "swap_blocks", "linear",
        "memory_efficient_attention_forward", "FwOp", "from_seqlens", "all_reduce", "create_ixformer_group_from_pg"}
    # the image's GPU libraries: ixformer, and xformers (the vision tower's attention since the adapter's 2f7d5f5);
    # and the adapter's prebuilt kernels, exactly the entry points their .cu sources define (pybind's module.def)
    assert all(name.startswith(("ixformer.", "xformers.", "vllm.corex_")) for name in REFERENCES)
    sources = require(NEWEST_FILES)
    defined = {f"vllm.{cu.stem}.{name}" for cu in sources.glob("corex_*.cu")
               for name in re.findall(r'module\.def\(\s*"(\w+)"', cu.read_text())}
    assert len({n.split(".")[1] for n in defined}) == 10
    assert {n for n in REFERENCES if n.startswith("vllm.corex_")} == defined
    assert {n for n in REFERENCES if n.startswith("xformers.")} == {
        "xformers.ops.memory_efficient_attention_forward", "xformers.ops.fmha.attn_bias.BlockDiagonalMask.from_seqlens"}
