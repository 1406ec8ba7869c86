"""The model adapter's CoreX Gated DeltaNet kernels at 2f7d5f5 (`qwen3_6_scripts/corex_gdn_*.cu`, built into
`vllm.corex_gdn_<name>` and imported by its `qwen3_5.py`), computed with plain torch on a CPU.

One function per pybind entry point, with the kernel's argument order, return value, in-place writes (the causal
conv shifts `state`, the packed decode updates the recurrent `state`) and output dtypes and shapes. Each
TORCH_CHECK is a RuntimeError with the kernel's message, in the kernel's order, except the `is_cuda` checks: the
CPU runtime's tensors are CPU tensors. The numerics are the kernel's: fp16 inputs widened to float32, rounded to
fp16 where the kernel rounds (`__float2half`, `__hmul`, `__hadd`), float32 elsewhere, in the kernel's order where
the order changes the result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_HEAD_DIM = 128
# the kernels' 1/sqrt(128) is a float literal (`f`): float32, as torch keeps a Python float times a float32 tensor
_QUERY_SCALE = 0.08838834764831845


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


def _check_tensor(tensor: torch.Tensor, name: str, dtype: torch.dtype, dtype_name: str) -> None:
    _check(tensor.dtype == dtype, f"{name} must have dtype {dtype_name}")
    _check(tensor.is_contiguous(), f"{name} must be contiguous")


def _half(x: torch.Tensor) -> torch.Tensor:
    """float32 -> fp16 (round to nearest even, `__float2half_rn`) -> float32."""
    return x.to(torch.float16).to(torch.float32)


def _silu(x: torch.Tensor) -> torch.Tensor:
    # the kernels' `x / (1 + expf(-x))`, not torch's x * sigmoid(x): they can differ in float32's last bit
    return x / (1.0 + torch.exp(-x))


# -- corex_gdn_causal_conv ------------------------------------------------------------------------------------------

_CONV_STATE_LEN = 3
_CONV_KERNEL_SIZE = _CONV_STATE_LEN + 1


def causal_conv_update(state: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One decode token's depthwise causal conv (kernel 4) and SiLU: `state` float32 `(batch, channels, 3)` is
    shifted in place (its oldest column dropped, `hidden` appended); returns fp16 `(batch, channels, 1)`."""
    _check_tensor(state, "state", torch.float32, "float32")
    _check_tensor(hidden, "hidden", torch.float16, "float16")
    _check_tensor(weight, "weight", torch.float16, "float16")
    _check(state.dim() == 3 and state.shape[2] == _CONV_STATE_LEN, "state must have shape (batch, channels, 3)")
    _check(hidden.dim() == 3 and hidden.shape[2] == 1 and hidden.shape[0] == state.shape[0]
           and hidden.shape[1] == state.shape[1], "hidden must have shape (batch, channels, 1)")
    _check(weight.dim() == 2 and weight.shape[0] == state.shape[1] and weight.shape[1] == _CONV_KERNEL_SIZE,
           "weight must have shape (channels, 4)")
    # the float32 state is read through fp16, and what is shifted back is that fp16 value, not the float32 one
    previous = _half(state)
    w = weight.to(torch.float32)
    current = hidden[..., 0].to(torch.float32)
    # fp16 x fp16 products are exact in float32; the sum runs oldest tap first, as the kernel adds them
    value = previous[..., 0] * w[:, 0]
    value = value + previous[..., 1] * w[:, 1]
    value = value + previous[..., 2] * w[:, 2]
    value = value + current * w[:, 3]
    state[..., 0] = previous[..., 1]
    state[..., 1] = previous[..., 2]
    state[..., 2] = current
    # the convolution is rounded to fp16 before the SiLU, and the SiLU again after
    convolved = _half(value)
    return _silu(convolved).to(torch.float16).unsqueeze(-1)


# -- corex_gdn_gated_norm -------------------------------------------------------------------------------------------

def apply_inverse(input: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                  inverse: torch.Tensor) -> torch.Tensor:
    """The gated RMSNorm given each row's inverse RMS (computed by the caller): `half(weight * (input * inverse) *
    silu(gate))`, input float32 `(rows, 128)`, gate fp16 like input, weight fp16 `(128,)`, inverse float32 with one
    value per row; returns fp16 like gate."""
    _check(input.dtype == torch.float32, "input must have dtype float32")
    _check(gate.dtype == torch.float16, "gate must have dtype float16")
    _check(weight.dtype == torch.float16, "weight must have dtype float16")
    _check(inverse.dtype == torch.float32, "inverse must have dtype float32")
    _check(input.is_contiguous() and gate.is_contiguous() and weight.is_contiguous() and inverse.is_contiguous(),
           "all tensors must be contiguous")
    _check(input.dim() == 2 and input.shape[1] == _HEAD_DIM, "input must have shape (rows, 128)")
    _check(gate.shape == input.shape, "gate must match input shape")
    _check(weight.dim() == 1 and weight.shape[0] == _HEAD_DIM, "weight must have shape (128,)")
    _check(inverse.numel() == input.shape[0], "inverse must contain one value per row")
    # three separately rounded float32 products (`__fmul_rn`: no FMA), in this order; one fp16 rounding at the end
    scaled = input * inverse.reshape(-1, 1)
    normalized = weight.to(torch.float32) * scaled
    return (normalized * _silu(gate.to(torch.float32))).to(torch.float16)


# -- corex_gdn_beta_decay -------------------------------------------------------------------------------------------

def _check_half_matrix_heads(tensor: torch.Tensor, name: str) -> None:
    _check_tensor(tensor, name, torch.float16, "float16")
    _check(tensor.dim() == 2, f"{name} must have shape (batch, heads)")


def _check_half_vector_heads(tensor: torch.Tensor, name: str) -> None:
    _check_tensor(tensor, name, torch.float16, "float16")
    _check(tensor.dim() == 1, f"{name} must have shape (heads)")


def _beta(beta_input: torch.Tensor) -> torch.Tensor:
    b = beta_input.to(torch.float32)
    # the sigmoid is rounded to fp16 and handed on as float32
    return _half(1.0 / (1.0 + torch.exp(-b)))


def _decay(decay_input: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    x = decay_input.to(torch.float32) + dt_bias.to(torch.float32)
    # softplus with the kernel's threshold (x > 20: x itself), in float32 throughout
    softplus = torch.where(x > 20.0, x, torch.log1p(torch.exp(x)))
    return torch.exp(-torch.exp(a_log.to(torch.float32)) * softplus)


def beta_decay(beta_input: torch.Tensor, decay_input: torch.Tensor, a_log: torch.Tensor,
               dt_bias: torch.Tensor) -> torch.Tensor:
    """float32 `(2, batch, heads)`: `[0]` the gate beta = sigmoid(beta_input) (rounded to fp16), `[1]` the decay
    factor exp(-exp(a_log) * softplus(decay_input + dt_bias)); inputs fp16 `(batch, heads)`, parameters `(heads,)`."""
    _check_half_matrix_heads(beta_input, "beta_input")
    _check_half_matrix_heads(decay_input, "decay_input")
    _check_half_vector_heads(a_log, "a_log")
    _check_half_vector_heads(dt_bias, "dt_bias")
    _check(beta_input.shape == decay_input.shape, "beta_input and decay_input shapes must match")
    _check(beta_input.shape[1] == a_log.shape[0] and a_log.shape == dt_bias.shape,
           "parameter heads must match input heads")
    return torch.stack((_beta(beta_input), _decay(decay_input, a_log, dt_bias)))


# -- corex_gdn_qk_map -----------------------------------------------------------------------------------------------

def _check_key_heads(tensor: torch.Tensor, name: str) -> None:
    _check_tensor(tensor, name, torch.float16, "float16")
    _check(tensor.dim() == 3 and tensor.shape[2] == _HEAD_DIM, f"{name} must have shape (batch, key_heads, 128)")


def qk_map(query: torch.Tensor, key: torch.Tensor, value_heads: int) -> torch.Tensor:
    """The (already normalised) fp16 query and key heads `(batch, key_heads, 128)` widened to float32 and repeated
    onto `value_heads` heads (value head h reads key head h // (value_heads // key_heads)), the query scaled by
    1/sqrt(128): float32 `(2, batch, value_heads, 128)`, `[0]` query, `[1]` key."""
    _check_key_heads(query, "query")
    _check_key_heads(key, "key")
    _check(query.shape == key.shape, "query and key shapes must match")
    key_heads = query.shape[1]
    _check(value_heads > 0 and value_heads % key_heads == 0, "value_heads must be divisible by key_heads")
    ratio = value_heads // key_heads
    q = query.to(torch.float32).repeat_interleave(ratio, dim=1) * _QUERY_SCALE
    k = key.to(torch.float32).repeat_interleave(ratio, dim=1)
    return torch.stack((q, k))


# -- corex_gdn_packed_decode ----------------------------------------------------------------------------------------

# the kernel is compiled for one rank of TP 4 on Qwen3.6-35B-A3B: 4 key heads, 8 value heads, head size 128
_PACKED_KEY_HEADS = 4
_PACKED_VALUE_HEADS = 8
_PACKED_MIXED_DIM = (2 * _PACKED_KEY_HEADS + _PACKED_VALUE_HEADS) * _HEAD_DIM
_L2_EPSILON = 1e-6


def _check_half_matrix_width(tensor: torch.Tensor, name: str, width: int) -> None:
    _check_tensor(tensor, name, torch.float16, "float16")
    _check(tensor.dim() == 2 and tensor.shape[1] == width, f"{name} must have shape (batch, {width})")


def _check_half_vector_value_heads(tensor: torch.Tensor, name: str) -> None:
    _check_tensor(tensor, name, torch.float16, "float16")
    _check(tensor.dim() == 1 and tensor.shape[0] == _PACKED_VALUE_HEADS,
           f"{name} must have shape ({_PACKED_VALUE_HEADS})")


def _half_l2_normalized(raw: torch.Tensor) -> torch.Tensor:
    """fp16 heads `(heads, 128)` over their fp16 L2 norm, as the kernel does it all in fp16: squares rounded
    (`__hmul`), summed by a pairwise tree whose every partial sum is rounded (`__hadd`, stride 64, 32, ..., 1), the
    epsilon added in fp16, the float32 rsqrt rounded to fp16, the product rounded; returned as float32."""
    squares = raw * raw
    stride = _HEAD_DIM // 2
    while stride > 0:
        squares = squares[:, :stride] + squares[:, stride:2 * stride]
        stride //= 2
    epsilon = torch.tensor(_L2_EPSILON, dtype=torch.float16)
    inverse = torch.rsqrt((squares + epsilon).to(torch.float32)).to(torch.float16)
    return (raw * inverse).to(torch.float32)


def packed_decode(state: torch.Tensor, mixed_qkv: torch.Tensor, beta_input: torch.Tensor,
                  decay_input: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """One decode token of one sequence through the gated delta rule, for 4 key / 8 value heads of 128:
    mixed_qkv fp16 `(1, 2048)` is [q heads, k heads, v heads] after the conv; q and k are L2-normalised in fp16
    (q then scaled by 1/sqrt(128)); beta and the decay as `beta_decay`; the recurrent state float32
    `(1, 8, k_dim, v_dim)` is decayed and updated in place (S <- decay*S + k (x) (v - k.decay*S) * beta); returns
    float32 `(1, 8, 128)`, q.S."""
    _check(state.dtype == torch.float32, "state must have dtype float32")
    _check(state.is_contiguous(), "state must be contiguous")
    _check(state.dim() == 4 and state.shape[0] == 1 and state.shape[1] == _PACKED_VALUE_HEADS
           and state.shape[2] == _HEAD_DIM and state.shape[3] == _HEAD_DIM, "state must have shape (1, 8, 128, 128)")
    _check_half_matrix_width(mixed_qkv, "mixed_qkv", _PACKED_MIXED_DIM)
    _check_half_matrix_width(beta_input, "beta_input", _PACKED_VALUE_HEADS)
    _check_half_matrix_width(decay_input, "decay_input", _PACKED_VALUE_HEADS)
    _check_half_vector_value_heads(a_log, "a_log")
    _check_half_vector_value_heads(dt_bias, "dt_bias")
    _check(mixed_qkv.shape[0] == 1 and beta_input.shape[0] == 1 and decay_input.shape[0] == 1,
           "packed decode only supports one sequence")
    _check(all(t.device == state.device for t in (mixed_qkv, beta_input, decay_input, a_log, dt_bias)),
           "all inputs must be on the same device")

    key_width = _PACKED_KEY_HEADS * _HEAD_DIM
    ratio = _PACKED_VALUE_HEADS // _PACKED_KEY_HEADS
    packed = mixed_qkv[0]
    raw_query = packed[:key_width].view(_PACKED_KEY_HEADS, _HEAD_DIM)
    raw_key = packed[key_width:2 * key_width].view(_PACKED_KEY_HEADS, _HEAD_DIM)
    value = packed[2 * key_width:].view(_PACKED_VALUE_HEADS, _HEAD_DIM).to(torch.float32)
    # each value head normalises its key head's q and k itself: the same numbers, repeated after
    query = (_half_l2_normalized(raw_query) * _QUERY_SCALE).repeat_interleave(ratio, dim=0)
    key = _half_l2_normalized(raw_key).repeat_interleave(ratio, dim=0)
    beta = _beta(beta_input[0])[:, None]
    decay = _decay(decay_input[0], a_log, dt_bias)[:, None]

    heads = state[0]  # (8, k_dim, v_dim): row = k, column = v, as the kernel indexes row * 128 + column
    # a thread per (head, v column) sums over k rows 0..127 in order, in float32; the CoreX clang may contract the
    # multiply-adds to FMAs, which moves float32's last bit only, far below the fp16 rounding of q and k
    memory = torch.zeros(_PACKED_VALUE_HEADS, _HEAD_DIM, dtype=torch.float32, device=state.device)
    for row in range(_HEAD_DIM):
        memory = memory + key[:, row:row + 1] * (heads[:, row] * decay)
    delta = (value - memory) * beta
    result = torch.zeros_like(memory)
    for row in range(_HEAD_DIM):
        updated = heads[:, row] * decay + key[:, row:row + 1] * delta
        heads[:, row] = updated
        result = result + query[:, row:row + 1] * updated
    return result.unsqueeze(0)


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "vllm.corex_gdn_causal_conv.causal_conv_update": causal_conv_update,
    "vllm.corex_gdn_gated_norm.apply_inverse": apply_inverse,
    "vllm.corex_gdn_beta_decay.beta_decay": beta_decay,
    "vllm.corex_gdn_qk_map.qk_map": qk_map,
    "vllm.corex_gdn_packed_decode.packed_decode": packed_decode,
}
