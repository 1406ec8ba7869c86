"""Mixture-of-experts in plain PyTorch, for a vLLM build whose ixformer lacks the fused MoE kernels.

Weight layout as in the model adapter: w13 (experts, 2 * intermediate, hidden) with the gate rows
first, then the up rows; w2 (experts, hidden, intermediate). Every function returns the partial
output of this tensor-parallel rank (before the all-reduce), in the hidden states' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from native_fastpaths import switches
from native_fastpaths.profiling import profiled


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in fp32, top-k, renormalise the k weights to sum to 1."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _swiglu(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    return F.silu(gate_up[..., :intermediate]) * gate_up[..., intermediate:]


def experts_loop(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:
    """The baseline: a Python loop over experts with a host sync per expert (what the adapter does)."""
    inter = w2.shape[-1]
    out = torch.zeros(hidden.shape[0], w2.shape[1], dtype=torch.float32, device=hidden.device)
    for e in range(w13.shape[0]):
        token_idx, slot = torch.nonzero(ids == e, as_tuple=True)
        if token_idx.numel() == 0:  # .numel() after nonzero: a host sync for every expert
            continue
        x = hidden[token_idx]
        y = _swiglu(x @ w13[e].t(), inter) @ w2[e].t()
        out.index_add_(0, token_idx, y.float() * weights[token_idx, slot, None])
    return out.to(hidden.dtype)


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


def experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor,
            top_k: int) -> torch.Tensor:
    """Route and run the experts, picking the path by token count (MOE_SMALL_BATCH_* switches)."""
    weights, ids = route(router_logits, top_k)
    if hidden.shape[0] <= switches.small_batch_threshold():
        variant = switches.small_batch_variant()
        if variant == "gemm":
            with profiled("moe.decode_gemm", hidden.device):
                return experts_decode_gemm(hidden, w13, w2, weights, ids)
        if variant == "bmm":
            with profiled("moe.decode_bmm", hidden.device):
                return experts_decode_bmm(hidden, w13, w2, weights, ids)
    with profiled("moe.prefill_sorted", hidden.device):
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
