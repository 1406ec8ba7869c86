"""Environment switches, read at call time so a server restart with new env needs no rebuild.

| variable                      | default | what it selects                                                    |
| ----------------------------- | ------- | ------------------------------------------------------------------ |
| MOE_NATIVE                    | 1       | native MoE experts instead of the adapter's per-expert loop         |
| MOE_SMALL_BATCH_VARIANT       | gemm    | decode path for few tokens: gemm (one GEMM per token over gathered  |
|                               |         | expert weights), bmm (one batched matmul), or segments (the sorted |
|                               |         | path: no weight gather, fastest where memory bandwidth is scarce)   |
| MOE_SMALL_BATCH_THRESHOLD     | 4       | up to this many tokens use the decode path; more use sorted segments |
| CHUNK_PARALLEL                | 1       | chunked GatedDeltaNet solves its triangular system with one call     |
| LOOP1_NATIVE                  | 1       | one-token GatedDeltaNet decode uses the recurrent step              |
| RMSNORM_NATIVE                | 1       | fp32 zero-centred / gated RMSNorm                                   |
| PREFIX_FLASH                  | 1       | tiled prefix attention over vLLM's paged KV cache                   |
| XFORMERS_SDPA_FALLBACK        | 1       | SDPA prefill for head_dim > 128 on the xFormers backend             |
| NATIVE_PROFILE                | 0       | time each fast path and print a table at exit (off: zero overhead)  |
"""

from __future__ import annotations

import os

DEFAULTS = {
    "MOE_NATIVE": "1",
    "MOE_SMALL_BATCH_VARIANT": "gemm",
    "MOE_SMALL_BATCH_THRESHOLD": "4",
    "CHUNK_PARALLEL": "1",
    "LOOP1_NATIVE": "1",
    "RMSNORM_NATIVE": "1",
    "PREFIX_FLASH": "1",
    "XFORMERS_SDPA_FALLBACK": "1",
    "NATIVE_PROFILE": "0",
}


def value(name: str) -> str:
    return os.environ.get(name, DEFAULTS[name])


def enabled(name: str) -> bool:
    return value(name).strip().lower() in ("1", "true", "yes", "on")


def small_batch_variant() -> str:
    variant = value("MOE_SMALL_BATCH_VARIANT").strip().lower()
    if variant not in ("gemm", "bmm", "segments"):
        raise ValueError(f"MOE_SMALL_BATCH_VARIANT must be gemm, bmm or segments, got {variant!r}")
    return variant


def small_batch_threshold() -> int:
    return int(value("MOE_SMALL_BATCH_THRESHOLD"))
