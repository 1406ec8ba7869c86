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
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


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


def _solve_loop(attn: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 - I by forward substitution, one row at a time (L strictly lower, stored as -L)."""
    attn = attn.clone()
    for i in range(1, attn.shape[-1]):
        row = attn[..., i, :i].clone()
        sub = attn[..., :i, :i].clone()
        attn[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
    return attn


def _solve_triangular(attn: torch.Tensor) -> torch.Tensor:
    """The same inverse with one batched triangular solve."""
    size = attn.shape[-1]
    eye = torch.eye(size, dtype=attn.dtype, device=attn.device)
    lower = eye - attn  # I + L, unit lower triangular
    return torch.linalg.solve_triangular(lower, eye.expand_as(lower), upper=False, unitriangular=True) - eye


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           solver: str = "triangular") -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked prefill: a unit lower-triangular system per chunk, then the carried state across chunks.

    solver: "triangular" (torch.linalg.solve_triangular, CHUNK_PARALLEL=1) or "loop" (per-row).
    """
    with profiled(f"gdn.chunk_{solver}", query.device):
        q, k, v = _prepare(query, key, value, use_qk_l2norm_in_kernel)
        batch, heads, seq, dk = k.shape
        dv = v.shape[-1]
        gf, bf = g.float().transpose(1, 2), beta.float().transpose(1, 2)
        pad = (chunk_size - seq % chunk_size) % chunk_size
        if pad:
            q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
            gf, bf = F.pad(gf, (0, pad)), F.pad(bf, (0, pad))
        n = (seq + pad) // chunk_size
        q, k, v = (t.reshape(batch, heads, n, chunk_size, t.shape[-1]) for t in (q, k, v))
        gc = gf.reshape(batch, heads, n, chunk_size).cumsum(-1)
        bc = bf.reshape(batch, heads, n, chunk_size)
        k_beta, v_beta = k * bc[..., None], v * bc[..., None]
        upper = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device), diagonal=0)
        strict_upper = torch.triu(upper, diagonal=1)
        decay = (gc[..., :, None] - gc[..., None, :]).tril().exp().tril()
        attn = -((k_beta @ k.transpose(-1, -2)) * decay).masked_fill(upper, 0)
        attn = (_solve_triangular(attn) if solver == "triangular" else _solve_loop(attn)) + torch.eye(
            chunk_size, dtype=attn.dtype, device=attn.device)
        value_c = attn @ v_beta
        k_cumdecay = attn @ (k_beta * gc.exp()[..., None])
        state = (torch.zeros(batch, heads, dk, dv, dtype=torch.float32, device=q.device) if initial_state is None
                 else initial_state.float().clone())
        out = torch.empty_like(value_c)
        for i in range(n):
            qi, ki = q[:, :, i], k[:, :, i]
            gi = gc[:, :, i]
            intra = (qi @ ki.transpose(-1, -2) * decay[:, :, i]).masked_fill(strict_upper, 0)
            v_new = value_c[:, :, i] - k_cumdecay[:, :, i] @ state
            out[:, :, i] = (qi * gi.exp()[..., None]) @ state + intra @ v_new
            state = state * gi[..., -1, None, None].exp() + (
                ki * (gi[..., -1, None] - gi).exp()[..., None]).transpose(-1, -2) @ v_new
        out = out.reshape(batch, heads, n * chunk_size, dv)[:, :, :seq]
        return out.transpose(1, 2).to(value.dtype), (state if output_final_state else None)


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
    """Drop-in for the adapter's module-level _torch_chunk_gated_delta_rule (CHUNK_PARALLEL picks the solver)."""
    from native_fastpaths import switches

    solver = "triangular" if switches.enabled("CHUNK_PARALLEL") else "loop"
    return chunk_gated_delta_rule(query, key, value, g, beta, chunk_size, initial_state, output_final_state,
                                  use_qk_l2norm_in_kernel, solver=solver)


def torch_recurrent_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                                     beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                                     output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False
                                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drop-in for the adapter's module-level _torch_recurrent_gated_delta_rule."""
    return recurrent_gated_delta_rule(query, key, value, g, beta, initial_state, output_final_state,
                                      use_qk_l2norm_in_kernel)
