"""RMSNorm variants of Qwen3.5/3.6, computed in fp32 and cast back."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from native_fastpaths.profiling import profiled


def rms_norm_zero_centered(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / rms(x) * (1 + weight): the weight is stored centred on zero."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).to(x.dtype)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The GatedDeltaNet output norm: norm(x) * weight * silu(gate), per value head (last dim)."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * weight.float() * F.silu(gate.float())).to(x.dtype)


def qwen3_5_rmsnorm_gated_forward(self: torch.nn.Module, hidden_states: torch.Tensor,
                                  gate: torch.Tensor) -> torch.Tensor:
    """Drop-in body for Qwen3_5RMSNormGated.forward(self, hidden_states, gate)."""
    with profiled("norm.gated", hidden_states.device):
        return rms_norm_gated(hidden_states, gate, self.weight, self.variance_epsilon)  # type: ignore[arg-type]
