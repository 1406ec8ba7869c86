"""patches/src/native_fastpaths/attention.py against attention written out step by step."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="patches/src tests need torch: pip install torch==2.13.0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "patches" / "src"))

from native_fastpaths.attention import sdpa_varlen_prefill  # noqa: E402


def reference(q, k, v, seq_lens, scale):  # type: ignore[no-untyped-def]
    """Loops over sequences, heads and query positions; causal; grouped KV by h // group."""
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads
    out = torch.zeros_like(q, dtype=torch.float64)
    start = 0
    for length in seq_lens:
        for h in range(heads):
            kh = h // group
            for i in range(length):
                qi = q[start + i, h].double()
                scores = torch.stack([(qi * k[start + j, kh].double()).sum() * scale for j in range(i + 1)])
                weights = torch.softmax(scores, dim=0)
                out[start + i, h] = sum(weights[j] * v[start + j, kh].double() for j in range(i + 1))
        start += length
    return out


@pytest.mark.parametrize("seq_lens", [[1], [3, 5], [7, 1, 4]])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 16), (8, 2, 32), (4, 1, 256)])
def test_matches_reference_fp32(seq_lens, heads, kv_heads, dim) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(sum(seq_lens) * 31 + heads + dim)
    tokens = sum(seq_lens)
    q = torch.randn(tokens, heads, dim, generator=gen)
    k = torch.randn(tokens, kv_heads, dim, generator=gen)
    v = torch.randn(tokens, kv_heads, dim, generator=gen)
    scale = 1 / math.sqrt(dim)
    got = sdpa_varlen_prefill(q, k, v, seq_lens, scale)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got.double(), reference(q, k, v, seq_lens, scale), atol=1e-5, rtol=1e-5)


def test_bf16_within_tolerance() -> None:
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(9, 16, 256, generator=gen)
    k = torch.randn(9, 2, 256, generator=gen)
    v = torch.randn(9, 2, 256, generator=gen)
    want = reference(q, k, v, [4, 5], 256 ** -0.5)
    got = sdpa_varlen_prefill(q.bfloat16(), k.bfloat16(), v.bfloat16(), [4, 5], 256 ** -0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)


def test_rejects_inconsistent_inputs() -> None:
    q = torch.zeros(4, 3, 8)
    kv = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="not a multiple"):
        sdpa_varlen_prefill(q, kv, kv, [4], 1.0)
    with pytest.raises(ValueError, match="sum to 5"):
        sdpa_varlen_prefill(torch.zeros(4, 2, 8), kv, kv, [2, 3], 1.0)
