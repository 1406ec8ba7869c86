"""What the native fast paths replace, re-implemented from the description in ../shared/ADAPTER.md (section 2) and
DESIGN.md (section 5): the baselines that tests compare results with and benchmarks/native.py compares speed with.
Reference code only: it is never deployed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def adapter_route(router_logits: torch.Tensor, top_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The adapter's pure-PyTorch routing: softmax over all experts in fp32, top-k, renormalise, cast to the
    hidden states' dtype."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return (weights / weights.sum(dim=-1, keepdim=True)).to(dtype), ids


def adapter_pure_pytorch_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                                 router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Qwen3_5MoeSparseBlock._pure_pytorch_experts at 5a1c8c7, both branches.

    One token: the k selected experts' w13 rows gathered into one matrix, one GEMM, SwiGLU, then one bmm over the
    gathered w2. More tokens: for each unique selected expert, its tokens found with a mask, F.linear on that
    expert's weight slices, the weighted result index_add-ed into an output in the hidden dtype.
    """
    weights, ids = adapter_route(router_logits, top_k, hidden.dtype)
    tokens, size = hidden.shape
    if tokens == 1:
        selected = ids[0]
        gate_up = F.linear(hidden, w13[selected].reshape(-1, size)).view(top_k, -1)
        gate, up = gate_up.chunk(2, dim=-1)
        per_expert = torch.bmm(w2[selected], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        return (per_expert * weights[0].unsqueeze(-1)).sum(0, keepdim=True).to(hidden.dtype)
    out = torch.zeros_like(hidden)
    for expert in ids.reshape(-1).unique().tolist():
        token_idx, slot = (ids == expert).nonzero(as_tuple=True)
        gate, up = F.linear(hidden[token_idx], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, token_idx, (y * weights[token_idx, slot].unsqueeze(-1)).to(out.dtype))
    return out


def experts_loop(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:
    """A Python loop over every expert with a host sync each (the plainest baseline), accumulated in fp32."""
    inter = w2.shape[-1]
    out = torch.zeros(hidden.shape[0], w2.shape[1], dtype=torch.float32, device=hidden.device)
    for e in range(w13.shape[0]):
        token_idx, slot = torch.nonzero(ids == e, as_tuple=True)
        if token_idx.numel() == 0:
            continue
        gate_up = hidden[token_idx] @ w13[e].t()
        y = (F.silu(gate_up[..., :inter]) * gate_up[..., inter:]) @ w2[e].t()
        out.index_add_(0, token_idx, y.float() * weights[token_idx, slot, None])
    return out.to(hidden.dtype)


def adapter_chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                                   beta: torch.Tensor, chunk_size: int = 64,
                                   initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                                   use_qk_l2norm_in_kernel: bool = False
                                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """_torch_chunk_gated_delta_rule at 5a1c8c7: q/k already at the value-head count, layout (B, S, H, D).

    Per chunk: the unit lower-triangular system solved by a loop over its rows (every chunk at once), then a
    sequential loop over chunks that computes the intra-chunk scores, the state's contribution and the new state.
    """
    def l2(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)

    if use_qk_l2norm_in_kernel:
        query, key = l2(query), l2(key)
    q, k, v, b, gg = (x.transpose(1, 2).contiguous().float() for x in (query, key, value, beta, g))
    batch, heads, seq, dk = k.shape
    dv = v.shape[-1]
    pad = (chunk_size - seq % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    b, gg = F.pad(b, (0, pad)), F.pad(gg, (0, pad))
    q = q * dk ** -0.5
    k_beta, v_beta = k * b.unsqueeze(-1), v * b.unsqueeze(-1)
    q, k, v, k_beta, v_beta = (x.reshape(batch, heads, -1, chunk_size, x.shape[-1])
                               for x in (q, k, v, k_beta, v_beta))
    gg = gg.reshape(batch, heads, -1, chunk_size).cumsum(-1)
    on_or_above = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device))
    decay = (gg.unsqueeze(-1) - gg.unsqueeze(-2)).tril().exp().tril()
    attn = -((k_beta @ k.transpose(-1, -2)) * decay).masked_fill(on_or_above, 0)
    for i in range(1, chunk_size):
        row = attn[..., i, :i].clone()
        above = attn[..., :i, :i].clone()
        attn[..., i, :i] = row + (row.unsqueeze(-1) * above).sum(-2)
    attn = attn + torch.eye(chunk_size, dtype=attn.dtype, device=attn.device)
    v = attn @ v_beta
    k_cumdecay = attn @ (k_beta * gg.exp().unsqueeze(-1))
    state = (torch.zeros(batch, heads, dk, dv, device=q.device) if initial_state is None
             else initial_state.to(v))
    out = torch.zeros_like(v)
    above_diagonal = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device), 1)
    for i in range(q.shape[2]):
        qi, ki, vi, gi = q[:, :, i], k[:, :, i], v[:, :, i], gg[:, :, i]
        scores = (qi @ ki.transpose(-1, -2) * decay[:, :, i]).masked_fill_(above_diagonal, 0)
        v_new = vi - k_cumdecay[:, :, i] @ state
        out[:, :, i] = (qi * gi[..., None].exp()) @ state + scores @ v_new
        state = state * gi[..., -1, None, None].exp() + (
            ki * (gi[..., -1, None] - gi).exp()[..., None]).transpose(-1, -2) @ v_new
    out = out.reshape(batch, heads, -1, dv)[:, :, :seq].transpose(1, 2).contiguous()
    return out, (state if output_final_state else None)
