"""GatedDeltaNet in plain PyTorch: causal depthwise conv, the recurrent step and the chunked prefill.

Shapes follow the model adapter: query/key (batch, seq, key_heads, dk), value (batch, seq, value_heads,
dv), g and beta (batch, seq, value_heads). Value head h reads key head h // (value_heads / key_heads).
The recurrent state is fp32 with layout (batch, value_heads, dk, dv) ([K, V]). Per step:
decay S by exp(g); u = beta * (v - S^T k); S += k u^T; output S^T q (q scaled by dk ** -0.5).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from native_fastpaths.profiling import profiled


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, use_qk_l2norm: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32, optional L2 norm, q scaled, key heads repeated to value heads; layout (B, H, S, D)."""
    q, k, v = query.float(), key.float(), value.float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    groups = v.shape[2] // k.shape[2]
    if v.shape[2] % k.shape[2]:
        raise ValueError(f"{v.shape[2]} value heads are not a multiple of {k.shape[2]} key heads")
    if groups > 1:
        q = q.repeat_interleave(groups, dim=2)
        k = k.repeat_interleave(groups, dim=2)
    q = q * (q.shape[-1] ** -0.5)
    # contiguous once here: every later matmul on a transposed view would copy it again
    return q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


def recurrent_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                               output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token by token; the decode path (seq 1) and the reference for the chunked form."""
    with profiled("gdn.recurrent", query.device):
        q, k, v = _prepare(query, key, value, use_qk_l2norm_in_kernel)
        batch, heads, seq, dk = k.shape
        dv = v.shape[-1]
        gf, bf = g.float().transpose(1, 2), beta.float().transpose(1, 2)  # (B, H, S)
        state = (torch.zeros(batch, heads, dk, dv, dtype=torch.float32, device=q.device) if initial_state is None
                 else initial_state.float().clone())
        out = torch.empty(batch, heads, seq, dv, dtype=torch.float32, device=q.device)
        for t in range(seq):
            state = state * gf[:, :, t, None, None].exp()
            kt = k[:, :, t]
            u = bf[:, :, t, None] * (v[:, :, t] - (state * kt[..., None]).sum(-2))
            state = state + kt[..., None] * u[..., None, :]
            out[:, :, t] = (state * q[:, :, t, :, None]).sum(-2)
        return out.transpose(1, 2).to(value.dtype), (state if output_final_state else None)


def _solve_triangular(attn: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 - I for every chunk at once with one batched triangular solve (L strictly lower, stored as -L)."""
    size = attn.shape[-1]
    eye = torch.eye(size, dtype=attn.dtype, device=attn.device)
    lower = eye - attn  # I + L, unit lower triangular
    return torch.linalg.solve_triangular(lower, eye.expand_as(lower), upper=False, unitriangular=True) - eye


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked prefill with everything that does not depend on the carried state done for all chunks at once.

    Per chunk i with carried state S_i: v_new_i = U_i - W_i S_i, out_i = Qg_i S_i + A_i v_new_i, and
    S_{i+1} = d_i S_i + Kd_i^T v_new_i. U and W (one triangular solve for every chunk instead of a loop over rows),
    Qg, Kd and the masked intra-chunk scores A are computed for all chunks at once, with the L2 norm, the q scale
    and beta folded into per-row factors so each big tensor is read as few times as possible; the loop keeps only
    the three matmuls that need S_i.
    """
    with profiled("gdn.chunk", query.device):
        batch, seq, key_heads, dk = key.shape
        heads, dv = value.shape[2], value.shape[3]
        if heads % key_heads:
            raise ValueError(f"{heads} value heads are not a multiple of {key_heads} key heads")
        groups = heads // key_heads
        # per-row factors: L2 norm (one reduction), q scale, beta
        q_factor = torch.full((), dk ** -0.5, device=query.device)
        k_factor = torch.ones((), device=query.device)
        if use_qk_l2norm_in_kernel:
            q_factor = torch.rsqrt(query.float().pow(2).sum(-1, keepdim=True) + 1e-6) * q_factor
            k_factor = torch.rsqrt(key.float().pow(2).sum(-1, keepdim=True) + 1e-6)
        pad = (chunk_size - seq % chunk_size) % chunk_size
        n = (seq + pad) // chunk_size

        def chunked(x: torch.Tensor, factor: torch.Tensor | None = None, repeat: int = 1) -> torch.Tensor:
            """(B, S, h, D) -> (B, H, n, C, D) fp32 in one copy, times the factor, heads repeated."""
            x = x.float() if factor is None else x.float() * factor
            if repeat > 1:
                x = x.repeat_interleave(repeat, dim=2)
            if pad:
                x = F.pad(x, (0, 0, 0, 0, 0, pad))
            return x.reshape(batch, n, chunk_size, heads, x.shape[-1]).permute(0, 3, 1, 2, 4).contiguous()

        q = chunked(query, q_factor, groups)
        k = chunked(key, k_factor, groups)
        v = chunked(value)
        gc = chunked(g.unsqueeze(-1)).squeeze(-1).cumsum(-1)  # (B, H, n, C)
        bc = chunked(beta.unsqueeze(-1))  # (B, H, n, C, 1)
        strict_upper = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device), 1)
        decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill_(strict_upper, float("-inf")).exp_()
        scores = k @ k.transpose(-1, -2)  # shared by the system and, with q, the intra-chunk scores
        attn = (scores.mul_(bc).mul_(decay)).neg_()
        attn.diagonal(dim1=-2, dim2=-1).zero_()
        attn = _solve_triangular(attn)
        attn.diagonal(dim1=-2, dim2=-1).add_(1)
        gexp = gc.exp().unsqueeze(-1)
        u = attn @ (v * bc)  # U_i
        w = attn @ (k * (bc * gexp))  # W_i
        intra = (q @ k.transpose(-1, -2)).mul_(decay)  # A_i: decay is zero above the diagonal
        q_decayed = q.mul_(gexp)  # Qg_i (q is not needed any more)
        last = gc[..., -1:]  # (B, H, n, 1)
        k_decayed_t = k.mul_((last - gc).exp_().unsqueeze(-1)).transpose(-1, -2)  # Kd_i^T
        chunk_decay = last.exp().unsqueeze(-1)  # d_i (B, H, n, 1, 1)
        state = (torch.zeros(batch, heads, dk, dv, dtype=torch.float32, device=q.device) if initial_state is None
                 else initial_state.float().clone())
        out = torch.empty_like(u)
        for i in range(n):  # the one sequential part: three matmuls with the state carried from chunk to chunk
            v_new = u[:, :, i] - w[:, :, i] @ state
            out[:, :, i] = q_decayed[:, :, i] @ state + intra[:, :, i] @ v_new
            state = state * chunk_decay[:, :, i] + k_decayed_t[:, :, i] @ v_new
        out = out.permute(0, 2, 3, 1, 4).reshape(batch, n * chunk_size, heads, dv)[:, :seq]
        return out.to(value.dtype), (state if output_final_state else None)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  initial_state: torch.Tensor | None = None, activation: str | None = "silu"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv for prefill. x (B, C, S), weight (C, K); returns (y (B, C, S), state (B, C, K-1))."""
    kernel = weight.shape[-1]
    history = (initial_state if initial_state is not None
               else torch.zeros(x.shape[0], x.shape[1], kernel - 1, dtype=x.dtype, device=x.device))
    padded = torch.cat([history.to(x.dtype), x], dim=-1)
    y = F.conv1d(padded, weight.unsqueeze(1).to(x.dtype), bias.to(x.dtype) if bias is not None else None,
                 groups=x.shape[1])
    if activation == "silu":
        y = F.silu(y)
    return y, padded[..., -(kernel - 1):].clone()


def causal_conv1d_update(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = "silu"
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step. x (B, C), state (B, C, K-1); returns (y (B, C), new state)."""
    window = torch.cat([state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # (B, C, K)
    y = (window.float() * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    if activation == "silu":
        y = F.silu(y)
    return y.to(x.dtype), window[..., 1:].clone()


def torch_chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
                                 output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False
                                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drop-in for the adapter's module-level _torch_chunk_gated_delta_rule (its prefill path; CHUNK_PARALLEL)."""
    return chunk_gated_delta_rule(query, key, value, g, beta, chunk_size, initial_state, output_final_state,
                                  use_qk_l2norm_in_kernel)


def torch_recurrent_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                                     beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                                     output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False
                                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drop-in for the adapter's module-level _torch_recurrent_gated_delta_rule."""
    return recurrent_gated_delta_rule(query, key, value, g, beta, initial_state, output_final_state,
                                      use_qk_l2norm_in_kernel)
