"""Mixture-of-experts in plain PyTorch, for a vLLM build whose ixformer lacks the fused MoE kernels.

Weight layout as in the model adapter: w13 (experts, 2 * intermediate, hidden) with the gate rows
first, then the up rows; w2 (experts, hidden, intermediate). Every function returns the partial
output of this tensor-parallel rank (before the all-reduce), in the hidden states' dtype.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from native_fastpaths import switches
from native_fastpaths.profiling import note, profiled


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in fp32, top-k, renormalise the k weights to sum to 1."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _swiglu(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    return F.silu(gate_up[..., :intermediate]) * gate_up[..., intermediate:]


def experts_decode_gemm(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                        ids: torch.Tensor) -> torch.Tensor:
    """Few tokens: per token one GEMM over the concatenated w13 rows of its k experts, then one bmm."""
    k = ids.shape[1]
    inter = w2.shape[-1]
    outs = []
    for t in range(hidden.shape[0]):
        sel = ids[t]
        gate_up = (w13[sel].reshape(k * 2 * inter, -1) @ hidden[t]).view(k, 2 * inter)
        act = _swiglu(gate_up, inter)  # (k, I)
        y = torch.bmm(w2[sel], act.unsqueeze(-1)).squeeze(-1)  # (k, H)
        outs.append((y.float() * weights[t, :, None]).sum(0))
    return torch.stack(outs).to(hidden.dtype)


def experts_decode_bmm(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                       ids: torch.Tensor) -> torch.Tensor:
    """Few tokens: one batched matmul over all token x expert pairs."""
    tokens, k = ids.shape
    inter = w2.shape[-1]
    flat = ids.reshape(-1)
    x = hidden.repeat_interleave(k, dim=0).unsqueeze(-1)  # (T*k, H, 1)
    gate_up = torch.bmm(w13[flat], x).squeeze(-1)  # (T*k, 2I)
    y = torch.bmm(w2[flat], _swiglu(gate_up, inter).unsqueeze(-1)).squeeze(-1)  # (T*k, H)
    return (y.float().view(tokens, k, -1) * weights[..., None]).sum(1).to(hidden.dtype)


def experts_prefill_sorted(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                           ids: torch.Tensor) -> torch.Tensor:
    """Many tokens: sort token x expert pairs by expert and run each expert on one contiguous segment.

    One host sync for all segment lengths instead of one per expert.
    """
    tokens, k = ids.shape
    inter = w2.shape[-1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // k
    gathered_w = weights.reshape(-1)[order]
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # the one host sync
    out = torch.zeros(tokens, w2.shape[1], dtype=torch.float32, device=hidden.device)
    start = 0
    for e, count in enumerate(counts):
        if count:
            end = start + count
            rows = token_of[start:end]  # a segment at a time keeps the working set small
            y = _swiglu(hidden[rows] @ w13[e].t(), inter) @ w2[e].t()
            out.index_add_(0, rows, y.float() * gathered_w[start:end, None])
            start = end
    return out.to(hidden.dtype)


def experts_direct(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                   ids: torch.Tensor) -> torch.Tensor:
    """Few tokens, no weight copy: one F.linear per (token, expert) pair on views of that expert's weights.

    The gathered variants copy every selected expert's rows (~12 MB per expert at the real shapes) before
    multiplying; a matrix-vector product on the weights in place reads them once.
    """
    inter = w2.shape[-1]
    out = torch.zeros(hidden.shape[0], w2.shape[1], dtype=torch.float32, device=hidden.device)
    for t, row in enumerate(ids.tolist()):  # one host sync for all pairs
        x = hidden[t:t + 1]
        for j, e in enumerate(row):
            y = F.linear(_swiglu(F.linear(x, w13[e]), inter), w2[e])
            out[t] += y[0].float() * weights[t, j]
    return out.to(hidden.dtype)


SMALL_BATCH = {
    "gemm": experts_decode_gemm,
    "bmm": experts_decode_bmm,
    "direct": experts_direct,
    "segments": experts_prefill_sorted,
}
# token-count buckets measured separately by `auto`, and the candidates worth measuring in each: the gathered
# variants copy k experts' weights per token, so they are only tried where the prior art found them best
BUCKETS = ((1, ("direct", "segments", "bmm", "gemm")), (2, ("direct", "segments", "bmm", "gemm")),
           (4, ("direct", "segments", "bmm")), (8, ("direct", "segments", "bmm")), (16, ("direct", "segments")))
MEASURE_BUDGET_S = 0.5  # a bucket's measurement stops trying new candidates past this
LOSER_FACTOR = 3.0  # a candidate this much slower than the best is not measured again in larger buckets

_chosen: dict[tuple[str, str, int], str] = {}
_losers: set[tuple[str, str, str]] = set()  # (device, dtype, candidate) far behind in a smaller bucket
measurements: list[dict[str, object]] = []  # one record per measured bucket (tests and TOOLKIT_PROFILE notes read it)


def chosen(device: torch.device, dtype: torch.dtype, tokens: int) -> str | None:
    """What `auto` runs for this many tokens here, once measured (None: not measured yet)."""
    limit, candidates = _bucket(tokens)
    if candidates == ("segments",):
        return "segments"
    return _chosen.get((device.type, str(dtype).removeprefix("torch."), limit))


def _bucket(tokens: int) -> tuple[int, tuple[str, ...]]:
    for limit, candidates in BUCKETS:
        if tokens <= limit:
            return limit, candidates
    return tokens, ("segments",)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _elapsed(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[torch.Tensor, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def _measure(key: tuple[str, str, int], candidates: tuple[str, ...], args: tuple[torch.Tensor, ...]
             ) -> tuple[str, torch.Tensor]:
    """Time the candidates on this call's real inputs; keep the fastest whose result equals the first one's."""
    device = args[0].device
    tolerance = 1e-4 if args[0].dtype == torch.float32 else 2e-2
    started = time.perf_counter()
    times: dict[str, float] = {}
    rejected: list[str] = []
    skipped: list[str] = []
    reference: torch.Tensor | None = None
    best: tuple[str, torch.Tensor] | None = None
    for name in candidates:
        if best is not None and (time.perf_counter() - started > MEASURE_BUDGET_S
                                 or (key[0], key[1], name) in _losers):
            skipped.append(name)
            continue
        fn = functools.partial(SMALL_BATCH[name], *args)
        out, seconds = _elapsed(fn, device)
        if reference is None:
            reference = out
        elif not torch.allclose(out.float(), reference.float(), rtol=tolerance, atol=tolerance):
            rejected.append(name)  # never pick a path that computes something else
            continue
        if best is None or seconds < 1.5 * times[best[0]]:
            seconds = min(seconds, _elapsed(fn, device)[1])  # a second look at the close ones only
        times[name] = seconds
        if best is None or seconds < times[best[0]]:
            best = (name, out)
    assert best is not None
    _losers.update((key[0], key[1], n) for n, t in times.items() if t > LOSER_FACTOR * times[best[0]])
    record = {"device": key[0], "dtype": key[1], "bucket": key[2], "chosen": best[0],
              "ms": {n: round(t * 1e3, 3) for n, t in times.items()}, "rejected": rejected, "skipped": skipped,
              "cost_ms": round((time.perf_counter() - started) * 1e3, 1)}
    measurements.append(record)
    line = (f"[native_fastpaths] MoE small batch on {key[0]} {key[1]}, up to {key[2]} token(s): {best[0]} ("
            + ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in times.items())
            + (f"; not equal, never used: {', '.join(rejected)}" if rejected else "")
            + (f"; not measured (over budget, or far behind in a smaller bucket): {', '.join(skipped)}"
               if skipped else "") + ")")
    print(line, file=sys.stderr, flush=True)
    note(line)
    return best


def small_batch(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    """The few-token path: a fixed variant (MOE_SMALL_BATCH_VARIANT), or `auto`, measured once per bucket."""
    variant = switches.small_batch_variant()
    args = (hidden, w13, w2, weights, ids)
    if variant != "auto":
        with profiled(f"moe.{variant}", hidden.device):
            return SMALL_BATCH[variant](*args)
    limit, candidates = _bucket(hidden.shape[0])
    key = (hidden.device.type, str(hidden.dtype).removeprefix("torch."), limit)
    chosen = _chosen.get(key)
    if chosen is None and _capturing(hidden.device):
        chosen = "bmm"  # no timing (and no host sync) inside a CUDA graph capture; measured after it
    if chosen is None:
        chosen, out = _measure(key, candidates, args)
        _chosen[key] = chosen
        return out
    with profiled(f"moe.{chosen}", hidden.device):
        return SMALL_BATCH[chosen](*args)


def experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor,
            top_k: int) -> torch.Tensor:
    """Route and run the experts: few tokens by small_batch, more as sorted segments (prefill)."""
    weights, ids = route(router_logits, top_k)
    if hidden.shape[0] <= switches.small_batch_threshold():
        return small_batch(hidden, w13, w2, weights, ids)
    with profiled("moe.segments", hidden.device):
        return experts_prefill_sorted(hidden, w13, w2, weights, ids)


def shared_expert(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  w_gate: torch.Tensor) -> torch.Tensor:
    """SwiGLU shared expert scaled by sigmoid(Linear(hidden, 1)); w_gate_up (2I, H), w_down (H, I), w_gate (1, H)."""
    inter = w_down.shape[-1]
    y = _swiglu(hidden @ w_gate_up.t(), inter) @ w_down.t()
    return y * torch.sigmoid(hidden @ w_gate.t())


def pure_pytorch_experts(self: torch.nn.Module, hidden_states: torch.Tensor,
                         router_logits: torch.Tensor) -> torch.Tensor:
    """Drop-in for Qwen3_5MoeSparseBlock._pure_pytorch_experts(self, hidden_states, router_logits)."""
    experts_module = self.experts
    if router_logits.shape[-1] != self.num_experts:
        raise ValueError(f"router_logits has {router_logits.shape[-1]} experts, the block {self.num_experts}")
    return experts(hidden_states, experts_module.w13_weight, experts_module.w2_weight, router_logits,
                   int(self.top_k))  # type: ignore[arg-type]
