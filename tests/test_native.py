"""The native fast paths against references written for clarity (loops, the recurrence step by step)."""

from __future__ import annotations

import ast
import json
import math
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="patches/src tests need torch: pip install torch==2.13.0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "patches" / "src"))

from adapter_reference import (  # noqa: E402
    adapter_chunk_gated_delta_rule,
    adapter_pure_pytorch_experts,
    experts_loop,
)
from native_fastpaths import gdn, moe, norm, prefix_attention, profiling, switches  # noqa: E402

TOKEN_COUNTS = [1, 2, 3, 4, 5, 64, 1000]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- MoE ---------------------------------------------------------------------------------------------

def moe_reference(hidden, w13, w2, logits, top_k):  # type: ignore[no-untyped-def]
    """Per token, per selected expert, in float64."""
    inter = w2.shape[-1]
    out = torch.zeros(hidden.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(hidden.shape[0]):
        probs = torch.softmax(logits[t].double(), -1)
        top = sorted(range(len(probs)), key=lambda e: -float(probs[e]))[:top_k]
        total = sum(float(probs[e]) for e in top)
        for e in top:
            gate_up = w13[e].double() @ hidden[t].double()
            act = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += (float(probs[e]) / total) * (w2[e].double() @ act)
    return out


def moe_inputs(tokens: int, experts: int = 8, hidden: int = 16, inter: int = 6, dtype=torch.float32, seed=0):  # type: ignore[no-untyped-def]
    g = gen(seed)
    return (torch.randn(tokens, hidden, generator=g).to(dtype),
            (torch.randn(experts, 2 * inter, hidden, generator=g) / 4).to(dtype),
            (torch.randn(experts, hidden, inter, generator=g) / 4).to(dtype),
            torch.randn(tokens, experts, generator=g))


def test_router_softmax_topk_renormalised() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    weights, ids = moe.route(logits, 2)
    assert ids.tolist() == [[1, 2]]
    p = torch.softmax(logits.double(), -1)[0]
    assert weights[0].tolist() == pytest.approx([float(p[1] / (p[1] + p[2])), float(p[2] / (p[1] + p[2]))])
    assert weights.dtype == torch.float32


PATHS = {"loop": experts_loop, "direct": moe.experts_direct, "gemm": moe.experts_decode_gemm,
         "bmm": moe.experts_decode_bmm, "segments": moe.experts_prefill_sorted}
AUTO_TOKENS = [1, 2, 3, 4, 8, 16]


@pytest.mark.parametrize("tokens", [*TOKEN_COUNTS, 8, 16])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_moe_paths_fp32(tokens: int, path: str) -> None:
    hidden, w13, w2, logits = moe_inputs(tokens, seed=tokens)
    weights, ids = moe.route(logits, 3)
    got = PATHS[path](hidden, w13, w2, weights, ids)
    assert got.shape == hidden.shape and got.dtype == hidden.dtype
    torch.testing.assert_close(got.double(), moe_reference(hidden, w13, w2, logits, 3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 2, 5, 64])
def test_the_adapter_reference_matches_the_step_by_step_reference(tokens: int) -> None:
    # the benchmark's baseline must compute the same thing, or its ratios mean nothing
    hidden, w13, w2, logits = moe_inputs(tokens, seed=tokens + 100)
    got = adapter_pure_pytorch_experts(hidden, w13, w2, logits, 3)
    torch.testing.assert_close(got.double(), moe_reference(hidden, w13, w2, logits, 3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", ["direct", "gemm", "bmm", "segments"])
def test_moe_paths_bf16(path: str) -> None:
    hidden, w13, w2, logits = moe_inputs(4, dtype=torch.bfloat16, seed=9)
    weights, ids = moe.route(logits, 2)
    got = PATHS[path](hidden, w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), moe_reference(hidden.float(), w13.float(), w2.float(), logits, 2),
                               atol=5e-2, rtol=5e-2)


def test_moe_fixed_variants_follow_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    hidden, w13, w2, logits = moe_inputs(5, seed=3)
    want = moe_reference(hidden, w13, w2, logits, 2)
    measured = len(moe.measurements)
    for variant in ("direct", "gemm", "bmm", "segments"):
        for threshold in ("1", "8"):
            monkeypatch.setenv("MOE_SMALL_BATCH_VARIANT", variant)
            monkeypatch.setenv("MOE_SMALL_BATCH_THRESHOLD", threshold)
            torch.testing.assert_close(moe.experts(hidden, w13, w2, logits, 2).double(), want, atol=1e-5, rtol=1e-5)
    assert len(moe.measurements) == measured, "a fixed variant never measures"
    monkeypatch.setenv("MOE_SMALL_BATCH_VARIANT", "fast")
    with pytest.raises(ValueError, match="auto, direct, gemm, bmm, segments"):
        moe.experts(hidden[:1], w13, w2, logits[:1], 2)


@pytest.fixture
def fresh_auto(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    """auto with no choice made yet in this process; returns the measurement records."""
    monkeypatch.setattr(moe, "_chosen", {})
    monkeypatch.setattr(moe, "_losers", set())
    records: list[dict[str, object]] = []
    monkeypatch.setattr(moe, "measurements", records)
    monkeypatch.delenv("MOE_SMALL_BATCH_VARIANT", raising=False)
    monkeypatch.delenv("MOE_SMALL_BATCH_THRESHOLD", raising=False)
    return records


@pytest.mark.parametrize("tokens", AUTO_TOKENS)
def test_auto_is_the_default_measures_once_per_bucket_and_is_exact(tokens: int, fresh_auto: list[dict[str, object]],
                                                                   capfd: pytest.CaptureFixture[str]) -> None:
    hidden, w13, w2, logits = moe_inputs(tokens, seed=tokens)
    want = moe_reference(hidden, w13, w2, logits, 3)
    first = moe.experts(hidden, w13, w2, logits, 3)
    torch.testing.assert_close(first.double(), want, atol=1e-5, rtol=1e-5)
    assert len(fresh_auto) == 1
    record = fresh_auto[0]
    assert record["chosen"] in moe.SMALL_BATCH and record["chosen"] in record["ms"]  # type: ignore[operator]
    assert record["rejected"] == []
    line = capfd.readouterr().err
    assert line.count("[native_fastpaths] MoE small batch") == 1 and f"{record['chosen']} (" in line
    again = moe.experts(hidden, w13, w2, logits, 3)  # same bucket: the cached choice, no new measurement
    torch.testing.assert_close(again, first, atol=1e-6, rtol=1e-6)
    assert len(fresh_auto) == 1 and "[native_fastpaths]" not in capfd.readouterr().err


def test_auto_never_picks_a_path_with_another_result(fresh_auto: list[dict[str, object]],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def wrong_but_fast(hidden, w13, w2, weights, ids):  # type: ignore[no-untyped-def]
        return torch.zeros_like(hidden)

    monkeypatch.setitem(moe.SMALL_BATCH, "bmm", wrong_but_fast)
    hidden, w13, w2, logits = moe_inputs(2, seed=1)
    got = moe.experts(hidden, w13, w2, logits, 3)
    torch.testing.assert_close(got.double(), moe_reference(hidden, w13, w2, logits, 3), atol=1e-5, rtol=1e-5)
    assert fresh_auto[0]["rejected"] == ["bmm"] and fresh_auto[0]["chosen"] != "bmm"


def test_auto_buckets_are_separate_and_large_batches_are_not_measured(fresh_auto: list[dict[str, object]]) -> None:
    for tokens in (1, 3, 4, 100):
        hidden, w13, w2, logits = moe_inputs(tokens, seed=tokens)
        moe.experts(hidden, w13, w2, logits, 3)
    assert [r["bucket"] for r in fresh_auto] == [1, 4]  # 3 and 4 share a bucket; 100 tokens take segments


def test_a_far_slower_candidate_is_not_measured_again(fresh_auto: list[dict[str, object]],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    real = moe.SMALL_BATCH["gemm"]

    def slow_gemm(*args):  # type: ignore[no-untyped-def]
        time.sleep(0.05)  # what copying the selected experts' weights costs on a CPU
        return real(*args)

    monkeypatch.setitem(moe.SMALL_BATCH, "gemm", slow_gemm)
    for tokens in (1, 2):
        hidden, w13, w2, logits = moe_inputs(tokens, seed=tokens)
        got = moe.experts(hidden, w13, w2, logits, 3)
        torch.testing.assert_close(got.double(), moe_reference(hidden, w13, w2, logits, 3), atol=1e-5, rtol=1e-5)
    assert "gemm" in fresh_auto[0]["ms"] and fresh_auto[0]["chosen"] != "gemm"  # type: ignore[operator]
    assert "gemm" in fresh_auto[1]["skipped"] and "gemm" not in fresh_auto[1]["ms"]  # type: ignore[operator]


def test_auto_choice_is_in_the_profile(fresh_auto: list[dict[str, object]], monkeypatch: pytest.MonkeyPatch,
                                       tmp_path: Path) -> None:
    monkeypatch.setattr(profiling, "ON", True)
    monkeypatch.setattr(profiling, "DIR", str(tmp_path))
    monkeypatch.setattr(profiling, "_notes", [])
    monkeypatch.setattr(profiling, "_stats", {})
    hidden, w13, w2, logits = moe_inputs(2, seed=5)
    moe.experts(hidden, w13, w2, logits, 3)  # measures the candidates, notes the choice
    moe.experts(hidden, w13, w2, logits, 3)  # runs the chosen path, in its region
    assert any("MoE small batch" in n for n in profiling._notes)
    written = Path(profiling.write_summary(final=True) or "").read_text()
    assert "MoE small batch" in written and '"region": "native.moe.' in written


def test_shared_expert() -> None:
    g = gen(5)
    x, wgu, wd, wg = (torch.randn(3, 8, generator=g), torch.randn(10, 8, generator=g),
                      torch.randn(8, 5, generator=g), torch.randn(1, 8, generator=g))
    got = moe.shared_expert(x, wgu, wd, wg)
    for t in range(3):
        gu = wgu.double() @ x[t].double()
        want = (wd.double() @ (torch.nn.functional.silu(gu[:5]) * gu[5:])) * torch.sigmoid(wg.double() @ x[t].double())
        torch.testing.assert_close(got[t].double(), want, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 40), experts=st.integers(2, 9), top_k=st.integers(1, 2), hidden=st.integers(1, 12),
       inter=st.integers(1, 7), seed=st.integers(0, 2**16))
def test_moe_paths_agree_on_any_shape(tokens: int, experts: int, top_k: int, hidden: int, inter: int,
                                      seed: int) -> None:
    x, w13, w2, logits = moe_inputs(tokens, experts, hidden, inter, seed=seed)
    weights, ids = moe.route(logits, top_k)
    want = experts_loop(x, w13, w2, weights, ids)
    for fn in moe.SMALL_BATCH.values():
        torch.testing.assert_close(fn(x, w13, w2, weights, ids), want, atol=1e-5, rtol=1e-5)


# -- GatedDeltaNet -----------------------------------------------------------------------------------

def gdn_reference(q, k, v, g, beta, state=None, l2=True):  # type: ignore[no-untyped-def]
    """Every batch, value head and step on its own, in float64, with explicit [dk, dv] matrices."""
    batch, seq, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    out = torch.zeros(batch, seq, hv, dv, dtype=torch.float64)
    final = torch.zeros(batch, hv, dk, dv, dtype=torch.float64)
    for b in range(batch):
        for h in range(hv):
            kh = h // (hv // hk)
            S = torch.zeros(dk, dv, dtype=torch.float64) if state is None else state[b, h].double().clone()
            for t in range(seq):
                qt, kt = q[b, t, kh].double(), k[b, t, kh].double()
                if l2:
                    qt, kt = qt / torch.sqrt((qt * qt).sum() + 1e-6), kt / torch.sqrt((kt * kt).sum() + 1e-6)
                qt = qt * dk ** -0.5
                S = S * math.exp(float(g[b, t, h]))
                u = float(beta[b, t, h]) * (v[b, t, h].double() - S.t() @ kt)
                S = S + torch.outer(kt, u)
                out[b, t, h] = S.t() @ qt
            final[b, h] = S
    return out, final


def gdn_inputs(seq: int, batch: int = 1, hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 12, seed: int = 0,
               dtype=torch.float32):  # type: ignore[no-untyped-def]
    g_ = gen(seed)
    q = torch.randn(batch, seq, hk, dk, generator=g_).to(dtype)
    k = torch.randn(batch, seq, hk, dk, generator=g_).to(dtype)
    v = torch.randn(batch, seq, hv, dv, generator=g_).to(dtype)
    a_log = torch.randn(hv, generator=g_)
    dt_bias = torch.randn(hv, generator=g_)
    a = torch.randn(batch, seq, hv, generator=g_)
    g = -torch.exp(a_log) * torch.nn.functional.softplus(a + dt_bias)  # as the model computes it
    beta = torch.sigmoid(torch.randn(batch, seq, hv, generator=g_))
    return q, k, v, g, beta


@pytest.mark.parametrize("seq", TOKEN_COUNTS)
def test_recurrent_matches_reference(seq: int) -> None:
    q, k, v, g, beta = gdn_inputs(seq, seed=seq)
    out, state = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
    want, want_state = gdn_reference(q, k, v, g, beta)
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state.double(), want_state, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seq", [1, 2, 3, 5, 63, 64, 65, 130, 1000])
@pytest.mark.parametrize("path", ["native", "adapter"])
def test_chunked_matches_reference(seq: int, path: str) -> None:
    q, k, v, g, beta = gdn_inputs(seq, batch=2, seed=seq + 7)
    init = torch.randn(2, 4, 8, 12, generator=gen(seq))
    if path == "native":
        out, state = gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=init, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
    else:  # the benchmark's baseline, called as the adapter calls it: q/k already at the value-head count
        out, state = adapter_chunk_gated_delta_rule(q.repeat_interleave(2, 2), k.repeat_interleave(2, 2), v, g,
                                                    beta, initial_state=init, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    assert state is not None
    want, want_state = gdn_reference(q, k, v, g, beta, state=init)
    torch.testing.assert_close(out.double(), want, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(state.double(), want_state, atol=2e-4, rtol=2e-4)


def test_state_layout_is_k_by_v() -> None:
    q, k, v, g, beta = gdn_inputs(3, seed=1)
    _, state = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    assert state.shape == (1, 4, 8, 12)  # dk != dv: a transposed [V, K] state cannot pass
    assert state.dtype == torch.float32


def test_prefill_then_decode_equals_one_long_recurrence() -> None:
    q, k, v, g, beta = gdn_inputs(200, seed=11)
    want, _ = gdn_reference(q, k, v, g, beta)
    out1, state = gdn.chunk_gated_delta_rule(q[:, :150], k[:, :150], v[:, :150], g[:, :150], beta[:, :150],
                                             output_final_state=True, use_qk_l2norm_in_kernel=True)
    outs = [out1]
    for t in range(150, 200):
        step, state = gdn.recurrent_gated_delta_rule(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                                     beta[:, t:t + 1], initial_state=state, output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True)
        outs.append(step)
    torch.testing.assert_close(torch.cat(outs, 1).double(), want, atol=2e-4, rtol=2e-4)


def test_bf16_inputs_within_tolerance() -> None:
    q, k, v, g, beta = gdn_inputs(70, seed=4, dtype=torch.bfloat16)
    out, _ = gdn.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert out.dtype == torch.bfloat16
    want, _ = gdn_reference(q.float(), k.float(), v.float(), g, beta)
    torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=3e-2)


def test_drop_in_entry_points_match_the_adapter() -> None:
    q, k, v, g, beta = gdn_inputs(70, seed=2)
    qe, ke = q.repeat_interleave(2, 2), k.repeat_interleave(2, 2)
    init = torch.randn(1, 4, 8, 12, generator=gen(3))
    want, want_state = adapter_chunk_gated_delta_rule(qe, ke, v, g, beta, initial_state=init, output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True)
    tri, state = gdn.torch_chunk_gated_delta_rule(qe, ke, v, g, beta, initial_state=init, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(tri, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, want_state, atol=1e-4, rtol=1e-4)
    tri, _ = gdn.torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    one, _ = gdn.torch_recurrent_gated_delta_rule(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1],
                                                  use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(one, tri[:, :1], atol=1e-5, rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(seq=st.integers(1, 150), hk=st.integers(1, 2), groups=st.integers(1, 3), dk=st.integers(1, 9),
       dv=st.integers(1, 9), chunk=st.sampled_from([4, 16, 64]), seed=st.integers(0, 2**16))
def test_chunked_equals_recurrent_on_any_shape(seq: int, hk: int, groups: int, dk: int, dv: int, chunk: int,
                                               seed: int) -> None:
    q, k, v, g, beta = gdn_inputs(seq, hk=hk, hv=hk * groups, dk=dk, dv=dv, seed=seed)
    a, sa = gdn.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)
    b, sb = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(sa, sb, atol=2e-4, rtol=2e-4)


def conv_reference(x, w, bias, history):  # type: ignore[no-untyped-def]
    kernel = w.shape[-1]
    full = torch.cat([history, x], -1).double()
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[-1]):
        window = full[..., t:t + kernel]
        out[..., t] = (window * w.double()).sum(-1) + bias.double()
    return torch.nn.functional.silu(out)


@pytest.mark.parametrize("seq", [1, 3, 64, 1000])
def test_causal_conv_prefill_and_decode(seq: int) -> None:
    g_ = gen(seq)
    x = torch.randn(2, 6, seq, generator=g_)
    w, bias = torch.randn(6, 4, generator=g_), torch.randn(6, generator=g_)
    history = torch.randn(2, 6, 3, generator=g_)
    y, state = gdn.causal_conv1d(x, w, bias, initial_state=history)
    torch.testing.assert_close(y.double(), conv_reference(x, w, bias, history), atol=1e-5, rtol=1e-5)
    # decode steps continue exactly where the prefill left off
    more = torch.randn(2, 6, 5, generator=g_)
    steps = []
    for t in range(5):
        out, state = gdn.causal_conv1d_update(more[..., t], state, w, bias)
        steps.append(out)
    whole, _ = gdn.causal_conv1d(torch.cat([x, more], -1), w, bias, initial_state=history)
    torch.testing.assert_close(torch.stack(steps, -1), whole[..., seq:], atol=1e-5, rtol=1e-5)


# -- RMSNorm -----------------------------------------------------------------------------------------

def test_zero_centred_rmsnorm() -> None:
    g_ = gen(1)
    x, w = torch.randn(5, 32, generator=g_).bfloat16(), torch.randn(32, generator=g_) * 0.1
    want = x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6) * (1 + w.double())
    got = norm.rms_norm_zero_centered(x, w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(norm.rms_norm_zero_centered(x.float(), w).double(), want, atol=1e-5, rtol=1e-5)


def test_gated_rmsnorm_drop_in() -> None:
    g_ = gen(2)
    x, z, w = torch.randn(3, 4, 16, generator=g_), torch.randn(3, 4, 16, generator=g_), torch.randn(16, generator=g_)
    want = (x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6) * w.double()
            * torch.nn.functional.silu(z.double()))

    class Stand(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(w)
            self.variance_epsilon = 1e-6

    got = norm.qwen3_5_rmsnorm_gated_forward(Stand(), x, z)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


# -- prefix attention over the paged cache -----------------------------------------------------------

def paged(keys, values, block_size, num_blocks, seed):  # type: ignore[no-untyped-def]
    """Write each sequence's context into shuffled blocks in vLLM 0.6.3's cache layout."""
    kv_heads, dim = keys[0].shape[1], keys[0].shape[2]
    x = 16 // keys[0].element_size()
    key_cache = torch.zeros(num_blocks, kv_heads, dim // x, block_size, x, dtype=keys[0].dtype)
    value_cache = torch.zeros(num_blocks, kv_heads, dim, block_size, dtype=keys[0].dtype)
    free = torch.randperm(num_blocks, generator=gen(seed)).tolist()
    max_blocks = max(-(-k.shape[0] // block_size) for k in keys) or 1
    tables = torch.zeros(len(keys), max_blocks, dtype=torch.int32)
    for b, (k, v) in enumerate(zip(keys, values, strict=True)):
        for pos in range(k.shape[0]):
            j, off = divmod(pos, block_size)
            if off == 0:
                tables[b, j] = free.pop()
            blk = int(tables[b, j])
            key_cache[blk, :, :, off, :] = k[pos].view(kv_heads, dim // x, x)
            value_cache[blk, :, :, off] = v[pos]
    return key_cache, value_cache, tables


@pytest.mark.parametrize("contexts,news", [([0], [5]), ([33], [1]), ([100, 7], [4, 9]), ([1000], [3])])
@pytest.mark.parametrize("tile", [16, 50, 4096])
def test_prefix_attention_matches_dense(contexts: list[int], news: list[int], tile: int) -> None:
    g_ = gen(sum(contexts) + tile)
    heads, kv_heads, dim, block = 4, 2, 16, 16
    ctx_k = [torch.randn(c, kv_heads, dim, generator=g_) for c in contexts]
    ctx_v = [torch.randn(c, kv_heads, dim, generator=g_) for c in contexts]
    q = [torch.randn(n, heads, dim, generator=g_) for n in news]
    k = [torch.randn(n, kv_heads, dim, generator=g_) for n in news]
    v = [torch.randn(n, kv_heads, dim, generator=g_) for n in news]
    key_cache, value_cache, tables = paged(ctx_k, ctx_v, block, 80, seed=1)
    starts = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()])
    got = prefix_attention.prefix_attention(torch.cat(q), torch.cat(k), torch.cat(v), key_cache, value_cache, tables,
                                            starts, torch.tensor(contexts), dim ** -0.5, tile=tile)
    for b, (c, n) in enumerate(zip(contexts, news, strict=True)):
        full_k = torch.cat([ctx_k[b], k[b]]).double().repeat_interleave(2, dim=1)
        full_v = torch.cat([ctx_v[b], v[b]]).double().repeat_interleave(2, dim=1)
        for i in range(n):
            for h in range(heads):
                scores = (full_k[: c + i + 1, h] @ q[b][i, h].double()) * dim ** -0.5
                want = torch.softmax(scores, 0) @ full_v[: c + i + 1, h]
                torch.testing.assert_close(got[starts[b] + i, h].double(), want, atol=1e-5, rtol=1e-5)


def test_prefix_drop_in_refuses_what_it_does_not_cover() -> None:
    t = torch.zeros(1, 2, 16)
    with pytest.raises(NotImplementedError):
        prefix_attention.forward_prefix(t, t, t, "fp8", t, t, t, t, t, t, 1, torch.zeros(2), None, 1.0, 1.0)


def test_the_switch_table_is_the_one_source_of_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    table = json.loads((Path(switches.__file__).with_name("switches.json")).read_text())
    assert {name: entry["default"] for name, entry in table.items()} == switches.DEFAULTS
    for name in table:
        monkeypatch.delenv(name, raising=False)
        assert switches.value(name) == table[name]["default"]
    assert switches.small_batch_variant() == table["MOE_SMALL_BATCH_VARIANT"]["default"] == "auto"
    assert switches.small_batch_threshold() == int(table["MOE_SMALL_BATCH_THRESHOLD"]["default"])
    assert all(entry["selects"] and entry["kind"] in ("dispatch", "setting") for entry in table.values())


BAD_FLAGS = ("01", " 1", "true", "on", "2", "")


@pytest.mark.parametrize("name", ["PREFIX_STATE", "XFORMERS_SDPA_FALLBACK", "TOOLKIT_PROFILE"])
@pytest.mark.parametrize("bad", BAD_FLAGS)
def test_a_flag_switch_refuses_every_other_spelling(name: str, bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, bad)
    with pytest.raises(switches.SwitchError) as raised:
        switches.on(name)
    message = str(raised.value)
    assert message.startswith(f"{name}={bad!r}: expected exactly 0 or 1 (read at ")
    assert "test_native.py:" in message and "switches.json" in message  # where it was read, and the table


def test_prefix_state_reads_its_switches_through_the_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    from native_fastpaths import prefix_state

    monkeypatch.setenv("PREFIX_STATE", "01")
    with pytest.raises(switches.SwitchError, match=r"PREFIX_STATE='01': expected exactly 0 or 1 \(read at .*"
                                                   r"prefix_state\.py:"):
        prefix_state.enabled()
    monkeypatch.setenv("PREFIX_STATE", "1")
    monkeypatch.setenv("PREFIX_STATE_CHECKPOINTS", "08")
    with pytest.raises(switches.SwitchError, match="PREFIX_STATE_CHECKPOINTS='08': expected a whole number"):
        prefix_state._registry(type("Scheduler", (), {})())


def test_a_count_or_choice_switch_is_strict(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, ok in (("16", True), ("0", True), ("016", False), (" 16", False), ("-1", False), ("1e3", False)):
        monkeypatch.setenv("MOE_SMALL_BATCH_THRESHOLD", raw)
        if ok:
            assert switches.small_batch_threshold() == int(raw)
        else:
            with pytest.raises(switches.SwitchError):
                switches.small_batch_threshold()
    monkeypatch.setenv("MOE_SMALL_BATCH_VARIANT", "Direct")
    with pytest.raises(switches.SwitchError, match="one of auto, direct, gemm, bmm, segments"):
        switches.small_batch_variant()


def _env_reads_of_switches(source: str, table: set[str]) -> list[str]:
    """Where a module reads a switch of the table from os.environ itself: by its name, or by a module constant
    holding it."""
    tree = ast.parse(source)
    constants = {t.id for node in tree.body if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                 and node.value.value in table for t in node.targets if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            reads = "environ" in ast.unparse(node.func) or "getenv" in ast.unparse(node.func)
        else:
            reads = isinstance(node, ast.Subscript) and "environ" in ast.unparse(node.value)
        if reads and any((isinstance(n, ast.Constant) and n.value in table)
                         or (isinstance(n, ast.Name) and n.id in constants) for n in ast.walk(node)):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_switch_has_a_second_reader() -> None:
    """Every switch of the table is read by switches.py alone: no other module of the package reads one from
    os.environ itself (the code the dispatch kind injects calls switches.on: test_states). A module that parses
    one again fails here, and the check itself sees such a read."""
    table = set(switches.TABLE)
    offenders = {path.name: found for path in sorted(Path(switches.__file__).parent.glob("*.py"))
                 if path.name != "switches.py"
                 and (found := _env_reads_of_switches(path.read_text(encoding="utf-8"), table))}
    assert offenders == {}
    mutant = 'import os\nSWITCH = "PREFIX_STATE"\ndef enabled():\n    return int(os.environ.get(SWITCH, "1")) == 1\n'
    assert _env_reads_of_switches(mutant, table) == ['4: os.environ.get(SWITCH, \'1\')']
    assert _env_reads_of_switches('import os\nx = os.environ["PREFIX_FLASH"]\n', table)


def test_a_worker_that_reads_another_prefix_state_refuses_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan carries the value the scheduler read; a worker whose side reads another value raises, naming both,
    instead of leaving the skipped tokens' state unrestored."""
    from native_fastpaths import prefix_state

    plan = {"rows": {0: {"switch": "1", "request": "r1", "start": 32, "restore": None, "captures": [],
                         "fresh": False, "carry_in": True, "carry_out": False}}, "evict": []}
    monkeypatch.setenv("PREFIX_STATE", "0")
    with pytest.raises(RuntimeError, match=r"planned request r1 with PREFIX_STATE='1' but this worker reads "
                                           r"PREFIX_STATE='0'"):
        prefix_state.begin_step(plan)
    monkeypatch.setenv("PREFIX_STATE", "1")
    prefix_state.begin_step(plan)
    assert prefix_state._rows == plan["rows"]
    prefix_state.begin_step(None)


def test_an_evicted_block_drops_every_checkpoint_over_it_and_the_workers_learn_it_once() -> None:
    """The allocator's eviction of one content hash drops the checkpoints whose chain holds it (ready or pending),
    and no other; the dropped keys go with the next plan, except one captured again before it was sent."""
    from native_fastpaths import prefix_state

    registry = prefix_state.Registry(8)
    assert registry.add((2, 12), (11, 12)) == [] and registry.add((3, 13), (11, 12, 13)) == []
    registry.next_pass()
    assert registry.add((1, 21), (21,)) == []  # pending in this pass
    prefix_state.evicted(12)
    assert list(registry.ready) == [] and list(registry.pending) == [(1, 21)]
    assert sorted(registry.take_dropped()) == [(2, 12), (3, 13)] and registry.take_dropped() == []
    assert 11 not in registry.holders and registry.holders == {21: {(1, 21)}}
    prefix_state.evicted(21)
    registry.next_pass()
    assert registry.add((1, 21), (21,)) == []  # captured again before the drop reached the workers
    assert registry.take_dropped() == [] and list(registry.pending) == [(1, 21)]
    prefix_state.evicted(99)  # a hash no checkpoint covers
    assert list(registry.pending) == [(1, 21)]


def test_a_scheduler_that_sends_delta_metadata_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """SPMD workers get delta metadata after a request's first chunk, without its plan: refused at the first pass
    (with PREFIX_STATE=0 there is no plan to lose)."""
    from types import SimpleNamespace

    from native_fastpaths import prefix_state

    monkeypatch.setenv("PREFIX_STATE", "0")
    prefix_state.begin_schedule(SimpleNamespace(scheduler_config=SimpleNamespace(send_delta_data=True)))
    monkeypatch.setenv("PREFIX_STATE", "1")
    scheduler = SimpleNamespace(scheduler_config=SimpleNamespace(send_delta_data=True))
    with pytest.raises(RuntimeError, match=r"delta metadata \(VLLM_USE_RAY_SPMD_WORKER=1\).*PREFIX_STATE=0"):
        prefix_state.begin_schedule(scheduler)
    scheduler.scheduler_config.send_delta_data = False
    prefix_state.begin_schedule(scheduler)
    assert isinstance(scheduler._prefix_state_registry, prefix_state.Registry)
