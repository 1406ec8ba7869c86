"""The model adapter's CoreX extension kernels at 2f7d5f5 (`wudixzy/competition` `qwen3_6_scripts/corex_*.cu`,
imported by its `qwen3_5.py` and `paged_attn.py` as `from vllm import corex_<name>`), computed with plain torch on
CPU tensors: the MoE kernels (`corex_moe_exact_reduce`, `corex_moe_weight_gather`, `corex_moe_direct_routed`) and
the attention kernels (`corex_attn_head_rms_norm`, `corex_paged_kv_gather`).

Each function is one `PYBIND11_MODULE` entry point: its arguments in the kernel's order, its result as pybind
returns it (a `std::vector<torch::Tensor>` comes back as a list), its output dtypes and shapes as the `.cu`
allocates them, and its `TORCH_CHECK`s as RuntimeErrors with the kernel's message, in the kernel's order. The
`is_cuda()` checks are left out: the CPU runtime's tensors are CPU tensors. Where a kernel indexes by an id it does
not bound (an expert id, a physical block), torch raises an IndexError where the kernel would read stray memory.

Numerics are the kernels': a half product (`__hmul`) or a `__float2half_rn` rounds to float16 where the kernel
rounds, sums run in float32 in the kernel's order. A product of two float16 values is exact in float32 (11 + 11
significant bits), so an `fmaf(w, x, sum)` of halves is the float32 sum `sum + w * x` with one rounding, and a
float32 sum of two halves rounded to float16 is `__hadd` (24 >= 2 * 11 + 2 bits: the double rounding is innocuous).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_HEAD_DIM = 256  # corex_attn_head_rms_norm: kHeadDim
_TOP_K = 8  # the MoE kernels: kTopK
_EXPERTS, _HIDDEN, _INTERMEDIATE = 256, 2048, 128  # corex_moe_direct_routed: one TP-4 rank of Qwen3.6-35B-A3B
_WARP = 32


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def _check_half(tensor: torch.Tensor, name: str) -> None:
    _check(tensor.dtype == torch.float16, f"{name} must have dtype float16")
    _check(tensor.is_contiguous(), f"{name} must be contiguous")


def _check_expert_ids(expert_ids: torch.Tensor) -> None:
    # the kernel checks is_cuda() && is_contiguous() in one message; only the contiguity half applies here
    _check(expert_ids.is_contiguous(), "expert_ids must be a contiguous CUDA tensor")
    _check(expert_ids.dtype == torch.int64, "expert_ids must have dtype int64")
    _check(expert_ids.dim() == 1 and expert_ids.numel() == _TOP_K, "expert_ids must have shape (8,)")


# -- corex_attn_head_rms_norm -----------------------------------------------------------------------------------

def prepare(input: torch.Tensor) -> list[torch.Tensor]:
    """`[converted, squares]`: the float16 heads in float32 and their squares; the adapter takes the mean and the
    rsqrt in PyTorch and hands the inverse to `apply_inverse`."""
    _check_half(input, "input")
    _check(input.dim() == 2 and input.shape[1] == _HEAD_DIM, "input must have shape (rows, 256)")
    converted = input.to(torch.float32)
    return [converted, converted * converted]  # exact: a half squared fits float32's significand


def apply_inverse(input: torch.Tensor, weight: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """`half((input * inverse[row]) * (1 + weight))`: Gemma's 1 + weight, each product rounded in float32."""
    _check(input.dtype == torch.float32, "input must have dtype float32")
    _check(weight.dtype == torch.float16, "weight must have dtype float16")
    _check(inverse.dtype == torch.float32, "inverse must have dtype float32")
    _check(input.is_contiguous() and weight.is_contiguous() and inverse.is_contiguous(),
           "all tensors must be contiguous")
    _check(input.dim() == 2 and input.shape[1] == _HEAD_DIM, "input must have shape (rows, 256)")
    _check(weight.dim() == 1 and weight.shape[0] == _HEAD_DIM, "weight must have shape (256,)")
    _check(inverse.numel() == input.shape[0], "inverse must contain one value per row")
    scaled = input * inverse.reshape(-1, 1)
    factor = 1.0 + weight.to(torch.float32)
    return (scaled * factor).to(torch.float16)


# -- corex_moe_exact_reduce -------------------------------------------------------------------------------------

def _weighted_products(expert_output: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    _check(expert_output.dtype == torch.float16 and weights.dtype == torch.float16, "inputs must have dtype float16")
    _check(expert_output.is_contiguous() and weights.is_contiguous(), "inputs must be contiguous")
    _check(expert_output.dim() == 2 and expert_output.shape[0] == _TOP_K, "expert_output must have shape (8, hidden)")
    _check(weights.dim() == 1 and weights.shape[0] == _TOP_K, "weights must have shape (8,)")
    # __hmul: each expert's weighted row rounds to half before any sum
    return (expert_output.to(torch.float32) * weights.to(torch.float32).unsqueeze(1)).to(torch.float16)


def serial_float(expert_output: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`[1, hidden]` float16: the 8 half products summed in float32 in expert order, rounded once."""
    products = _weighted_products(expert_output, weights)
    total = products[0].to(torch.float32)  # the kernel starts from product 0, not 0.0f (a -0 stays -0)
    for expert in range(1, _TOP_K):
        total = total + products[expert].to(torch.float32)
    return total.to(torch.float16).unsqueeze(0)


def tree_float(expert_output: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`[1, hidden]` float16: the 8 half products summed in float32 as ((0+1)+(2+3)) + ((4+5)+(6+7))."""
    p = _weighted_products(expert_output, weights).to(torch.float32)
    total = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))
    return total.to(torch.float16).unsqueeze(0)


def serial_half(expert_output: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`[1, hidden]` float16: the 8 half products summed in expert order, every partial sum rounded to half."""
    products = _weighted_products(expert_output, weights)
    total = products[0]
    for expert in range(1, _TOP_K):
        total = (total.to(torch.float32) + products[expert].to(torch.float32)).to(torch.float16)  # __hadd
    return total.unsqueeze(0)


# -- corex_moe_weight_gather ------------------------------------------------------------------------------------

def _check_weight(tensor: torch.Tensor, name: str) -> None:
    _check_half(tensor, name)
    _check(tensor.dim() == 3, f"{name} must be rank three")
    _check(tensor.shape[1] * tensor.shape[2] % 8 == 0, f"{name} expert slices must be divisible by 16 bytes")


def weight_gather(w13: torch.Tensor, w2: torch.Tensor, expert_ids: torch.Tensor) -> list[torch.Tensor]:
    """`[w13[expert_ids], w2[expert_ids]]`: the 8 selected experts' weights, slot by slot, as new tensors."""
    _check_weight(w13, "w13")
    _check_weight(w2, "w2")
    _check(w13.device == w2.device, "W13/W2 must be on the same device")
    _check(w13.shape[0] == w2.shape[0], "W13/W2 expert counts differ")
    _check(w13.shape[2] == w2.shape[1], "W13/W2 hidden dimensions differ")
    _check(w13.shape[1] == 2 * w2.shape[2], "W13/W2 intermediate dimensions differ")
    _check(expert_ids.is_contiguous(), "expert_ids must be a contiguous CUDA tensor")
    _check(expert_ids.device == w13.device, "weights and expert_ids must be on the same device")
    _check(expert_ids.dtype == torch.int64, "expert_ids must have dtype int64")
    _check(expert_ids.dim() == 1 and expert_ids.numel() == _TOP_K, "expert_ids must have shape (8,)")
    return [w13.index_select(0, expert_ids), w2.index_select(0, expert_ids)]


# -- corex_moe_direct_routed ------------------------------------------------------------------------------------

def _warp_dots(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """float32 `weight @ x` row by row as one warp computes a row: lane l takes the half2 pairs l, l + 32, ...
    and accumulates `fmaf(w.x, x.x, sum)` then `fmaf(w.y, x.y, sum)` from 0.0f; the lanes are then folded by
    `__shfl_down_sync` with offsets 16, 8, 4, 2, 1 (lane 0's sum). weight: `[..., rows, n]` half, x: `[..., n]`."""
    n = weight.shape[-1]
    products = weight.to(torch.float32) * x.to(torch.float32).unsqueeze(-2)  # exact: products of halves
    per_lane = products.reshape(*products.shape[:-1], n // (2 * _WARP), _WARP, 2)  # [..., step, lane, pair]
    sums = torch.zeros((*per_lane.shape[:-3], _WARP), dtype=torch.float32)
    for step in range(per_lane.shape[-3]):
        sums = sums + per_lane[..., step, :, 0]
        sums = sums + per_lane[..., step, :, 1]
    offset = _WARP // 2
    while offset:
        sums = sums[..., :offset] + sums[..., offset:2 * offset]
        offset //= 2
    return sums[..., 0]


def w13(input: torch.Tensor, w13: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """`[8, 256]` float16: slot s is the selected expert's gate and up rows (`w13[expert_ids[s]]`, gate first)
    times the token, a float32 dot product per row rounded to half."""
    _check_half(input, "input")
    _check_half(w13, "w13")
    _check_expert_ids(expert_ids)
    _check(input.dim() == 2 and input.shape[0] == 1 and input.shape[1] == _HIDDEN, "input must have shape (1, 2048)")
    _check(w13.dim() == 3 and tuple(w13.shape) == (_EXPERTS, 2 * _INTERMEDIATE, _HIDDEN),
           "w13 must have shape (256, 256, 2048)")
    return _warp_dots(w13.index_select(0, expert_ids), input[0]).to(torch.float16)


def w2_reduce(activated: torch.Tensor, w2: torch.Tensor, expert_ids: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
    """`[1, 2048]` float16: each slot's down projection rounded to half, times its routing weight (a half
    product), summed over the slots in float32 from 0.0f in slot order, rounded once."""
    _check_half(activated, "activated")
    _check_half(w2, "w2")
    _check_half(weights, "weights")
    _check_expert_ids(expert_ids)
    _check(activated.dim() == 2 and activated.shape[0] == _TOP_K and activated.shape[1] == _INTERMEDIATE,
           "activated must have shape (8, 128)")
    _check(w2.dim() == 3 and tuple(w2.shape) == (_EXPERTS, _HIDDEN, _INTERMEDIATE),
           "w2 must have shape (256, 2048, 128)")
    _check(weights.dim() == 1 and weights.numel() == _TOP_K, "weights must have shape (8,)")
    expert_half = _warp_dots(w2.index_select(0, expert_ids), activated).to(torch.float16)  # [8, 2048]
    products = (expert_half.to(torch.float32) * weights.to(torch.float32).unsqueeze(1)).to(torch.float16)  # __hmul
    total = torch.zeros(_HIDDEN, dtype=torch.float32)
    for slot in range(_TOP_K):
        total = total + products[slot].to(torch.float32)
    return total.to(torch.float16).unsqueeze(0)


# -- corex_paged_kv_gather --------------------------------------------------------------------------------------

def paged_kv_gather(key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_len: int) -> list[torch.Tensor]:
    """`[keys, values]` of one sequence's first seq_len positions in float32: keys `[kv_heads, head_size,
    seq_len]`, values `[kv_heads, seq_len, head_size]`, from vLLM 0.6.3's paged layout (key `[blocks, kv_heads,
    head_size // x, block_size, x]`, value `[blocks, kv_heads, head_size, block_size]`)."""
    _check_half(key_cache, "key_cache")
    _check_half(value_cache, "value_cache")
    _check(block_table.dtype == torch.int32, "block_table must have dtype int32")
    _check(block_table.is_contiguous(), "block_table must be contiguous")
    _check(key_cache.dim() == 5, "key_cache must have shape (blocks, kv_heads, d/x, block, x)")
    _check(value_cache.dim() == 4, "value_cache must have shape (blocks, kv_heads, d, block)")
    _check(block_table.dim() == 1, "block_table must be a one-dimensional row")
    _check(key_cache.shape[0] == value_cache.shape[0], "key/value block counts differ")
    _check(key_cache.shape[1] == value_cache.shape[1], "key/value KV-head counts differ")
    _check(key_cache.shape[3] == value_cache.shape[3], "key/value block sizes differ")
    _check(key_cache.shape[2] * key_cache.shape[4] == value_cache.shape[2], "key/value head sizes differ")
    _check(seq_len > 0, "seq_len must be positive")
    block_size = value_cache.shape[3]
    _check((seq_len + block_size - 1) // block_size <= block_table.numel(), "block_table is too short for seq_len")
    positions = torch.arange(seq_len)
    blocks = block_table.to(torch.int64)[positions // block_size]
    offsets = positions % block_size
    keys = key_cache[blocks, :, :, offsets, :].flatten(-2)  # [seq_len, kv_heads, head_size]
    values = value_cache[blocks, :, :, offsets]  # [seq_len, kv_heads, head_size]
    return [keys.permute(1, 2, 0).to(torch.float32).contiguous(),
            values.permute(1, 0, 2).to(torch.float32).contiguous()]


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "vllm.corex_attn_head_rms_norm.prepare": prepare,
    "vllm.corex_attn_head_rms_norm.apply_inverse": apply_inverse,
    "vllm.corex_moe_exact_reduce.serial_float": serial_float,
    "vllm.corex_moe_exact_reduce.tree_float": tree_float,
    "vllm.corex_moe_exact_reduce.serial_half": serial_half,
    "vllm.corex_moe_weight_gather.gather": weight_gather,
    "vllm.corex_moe_direct_routed.w13": w13,
    "vllm.corex_moe_direct_routed.w2_reduce": w2_reduce,
    "vllm.corex_paged_kv_gather.gather": paged_kv_gather,
}
