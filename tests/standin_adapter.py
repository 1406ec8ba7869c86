"""A small stand-in for the model adapter's qwen3_5.py, with the layout the real one exposes.

The real adapter (enginex-vllm-bi100-qwen36) is unreachable from here; this module has the same
module-level functions, classes and methods the recipes dispatch into, written in the adapter's
plain style (per-expert loop, token-by-token recurrence), and imports nothing but torch.
It is written into a git repository by the tests, as the adapter would be checked out.
"""

SOURCE = '''\
"""Stand-in for the model adapter's qwen3_5.py (test fixture)."""

import torch
import torch.nn.functional as F


def _l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _torch_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                                      use_qk_l2norm_in_kernel=False):
    q, k, v = query.float(), key.float(), value.float()
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    groups = v.shape[2] // k.shape[2]
    q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    q = q * q.shape[-1] ** -0.5
    batch, seq, heads, dk = k.shape
    state = torch.zeros(batch, heads, dk, v.shape[-1]) if initial_state is None else initial_state.float().clone()
    out = torch.zeros(batch, seq, heads, v.shape[-1])
    for t in range(seq):
        state = state * g[:, t].float().exp()[..., None, None]
        kt = k[:, t]
        u = beta[:, t].float()[..., None] * (v[:, t] - (state * kt[..., None]).sum(-2))
        state = state + kt[..., None] * u[..., None, :]
        out[:, t] = (state * q[:, t, :, :, None]).sum(-2)
    return out.to(value.dtype), (state if output_final_state else None)


def _torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                  output_final_state=False, use_qk_l2norm_in_kernel=False):
    # the stand-in computes the chunked form by the plain recurrence: the same numbers
    return _torch_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state, output_final_state,
                                             use_qk_l2norm_in_kernel)


class Qwen3_5RMSNormGated(torch.nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states, gate):
        dtype = hidden_states.dtype
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * x * F.silu(gate.float())).to(dtype)


class _Experts(torch.nn.Module):
    def __init__(self, num_experts, hidden, inter):
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.randn(num_experts, 2 * inter, hidden) / 4)
        self.w2_weight = torch.nn.Parameter(torch.randn(num_experts, hidden, inter) / 4)


class Qwen3_5MoeSparseBlock(torch.nn.Module):
    def __init__(self, num_experts=8, top_k=2, hidden=16, inter=6):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.experts = _Experts(num_experts, hidden, inter)

    def _pure_pytorch_experts(self, hidden_states, router_logits):
        probs = torch.softmax(router_logits.float(), dim=-1)
        weights, selected = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        inter = self.experts.w2_weight.shape[-1]
        out = torch.zeros(hidden_states.shape[0], self.experts.w2_weight.shape[1])
        for e in range(self.num_experts):
            idx, slot = torch.where(selected == e)
            if idx.numel() == 0:
                continue
            gate_up = hidden_states[idx] @ self.experts.w13_weight[e].t()
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            out.index_add_(0, idx, (act @ self.experts.w2_weight[e].t()) * weights[idx, slot, None])
        return out.to(hidden_states.dtype)
'''
