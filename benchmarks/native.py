"""Native fast paths vs their references, at the real model's shapes, in one run.

Qwen3.6-35B-A3B: hidden 2048, 256 experts, top-k 8, expert intermediate 512; GatedDeltaNet with
16 key / 32 value heads of 128. Each row times the reference and the fast path on the same inputs
and prints the ratio (reference / fast: above 1 means the fast path is faster).

    python benchmarks/native.py                 # CPU, fp32
    python benchmarks/native.py --device cuda   # GPU, bf16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "patches" / "src"))
from native_fastpaths import gdn, moe, norm, prefix_attention

HIDDEN, EXPERTS, TOP_K, INTER = 2048, 256, 8, 512
HK, HV, DK, DV = 16, 32, 128, 128


def once(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def timed_pair(ref: Callable[[], object], fast: Callable[[], object], device: torch.device,
               repeat: int) -> tuple[float, float]:
    """Medians of alternating runs, so drift in the machine's load hits both sides alike."""
    ref(), fast()  # warm-up
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(repeat):
        order = ((0, ref), (1, fast)) if i % 2 == 0 else ((1, fast), (0, ref))
        for side, fn in order:
            times[side].append(once(fn, device))
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--gdn-tokens", type=int, default=4096)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    rows: list[tuple[str, str, float, float, float | None, str]] = []

    def row(name: str, shape: str, ref: Callable[[], object], fast: Callable[[], object], goal: float | None,
            scope: str, repeat: int | None = None) -> None:
        r, f = timed_pair(ref, fast, device, repeat or args.repeat)
        rows.append((name, shape, r, f, goal, scope))
        print(f"  measured {name} {shape}: {r * 1e3:.2f} ms vs {f * 1e3:.2f} ms", file=sys.stderr, flush=True)

    on_gpu = device.type == "cuda"

    def bench_moe() -> None:  # a function of its own so the 3 GB of expert weights are freed after it
        w13 = rand(EXPERTS, 2 * INTER, HIDDEN, scale=0.02)
        w2 = rand(EXPERTS, HIDDEN, INTER, scale=0.02)
        goal, scope = (2.0, "gpu>=2x") if on_gpu else (1.0, "cpu>=1x")
        for tokens in (1, 2, 4):
            weights, ids = moe.route(rand(tokens, EXPERTS), TOP_K)
            inputs = (rand(tokens, HIDDEN), w13, w2, weights, ids)
            loop = partial(moe.experts_loop, *inputs)
            row("moe decode gemm vs loop", f"{tokens} tok", loop, partial(moe.experts_decode_gemm, *inputs),
                goal, scope)
            row("moe decode bmm vs loop", f"{tokens} tok", loop, partial(moe.experts_decode_bmm, *inputs), goal, scope)
            row("moe decode segments vs loop", f"{tokens} tok", loop, partial(moe.experts_prefill_sorted, *inputs),
                goal, scope)
        weights, ids = moe.route(rand(1024, EXPERTS), TOP_K)
        inputs = (rand(1024, HIDDEN), w13, w2, weights, ids)
        row("moe prefill sorted vs loop", "1024 tok", partial(moe.experts_loop, *inputs),
            partial(moe.experts_prefill_sorted, *inputs), 3.0 if on_gpu else 1.0,
            "gpu>=3x" if on_gpu else "cpu>=1x", repeat=6)

    bench_moe()

    n = args.gdn_tokens
    q, k = rand(1, n, HK, DK), rand(1, n, HK, DK)
    v = rand(1, n, HV, DV)
    gate = -torch.rand(1, n, HV, generator=g).to(device) * 0.1
    beta = torch.rand(1, n, HV, generator=g).to(device)
    row("gdn chunked solve_triangular vs row loop", f"{n} tok",
        lambda: gdn.chunk_gated_delta_rule(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True, solver="loop"),
        lambda: gdn.chunk_gated_delta_rule(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True, solver="triangular"),
        2.0, ">=2x", repeat=4)
    # the triangular system alone, where the two solvers differ (the rest of the chunked path is shared)
    system = -torch.rand(1, HV, n // 64, 64, 64, generator=g).to(device).tril(-1) * 0.1
    row("gdn triangular system only: solve vs row loop", f"{n // 64}x64x64", lambda: gdn._solve_loop(system),
        lambda: gdn._solve_triangular(system), None, "for information")
    state = torch.zeros(1, HV, DK, DV, device=device)
    q1, k1, v1, g1, b1 = q[:, :1], k[:, :1], v[:, :1], gate[:, :1], beta[:, :1]
    row("gdn one-step recurrence vs chunked(1 tok)", "1 tok",
        lambda: gdn.chunk_gated_delta_rule(q1, k1, v1, g1, b1, initial_state=state, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True),
        lambda: gdn.recurrent_gated_delta_rule(q1, k1, v1, g1, b1, initial_state=state, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True), 2.0, ">=2x", repeat=20)

    x, z, w = rand(n, HV, DV), rand(n, HV, DV), rand(DV)

    def naive_gated() -> torch.Tensor:  # the adapter's form: several dtype round trips
        xf = x.float()
        var = xf.pow(2).mean(-1, keepdim=True)
        y = (xf * torch.rsqrt(var + 1e-6)).to(x.dtype)
        return (w * y * torch.nn.functional.silu(z.float()).to(x.dtype))

    row("gated rmsnorm fp32 vs adapter form", f"{n}x{HV}x{DV}", naive_gated,
        lambda: norm.rms_norm_gated(x, z, w), None, "for information")

    heads, kv_heads, dim, block = 16, 2, 256, 16
    context, new = 8192, 256
    xsize = 16 // torch.tensor([], dtype=dtype).element_size()
    blocks = context // block + 1
    key_cache = rand(blocks, kv_heads, dim // xsize, block, xsize)
    value_cache = rand(blocks, kv_heads, dim, block)
    table = torch.arange(blocks, dtype=torch.int32, device=device).unsqueeze(0)
    qn, kn, vn = rand(new, heads, dim), rand(new, kv_heads, dim), rand(new, kv_heads, dim)
    starts = torch.tensor([0, new], device=device)
    ctx = torch.tensor([context], device=device)

    def dense() -> torch.Tensor:
        ks, vs = prefix_attention.gather_context(key_cache, value_cache, table[0], 0, context)
        full_k = torch.cat([ks, kn.transpose(0, 1)], 1).repeat_interleave(heads // kv_heads, 0).float()
        full_v = torch.cat([vs, vn.transpose(0, 1)], 1).repeat_interleave(heads // kv_heads, 0).float()
        scores = qn.transpose(0, 1).float() @ full_k.transpose(-1, -2) * dim ** -0.5
        mask = torch.ones(new, context + new, dtype=torch.bool, device=device).triu(context + 1)
        return torch.softmax(scores.masked_fill(mask, float("-inf")), -1) @ full_v

    row("prefix attention tiled vs dense", f"ctx {context} + {new}", dense,
        lambda: prefix_attention.prefix_attention(qn, kn, vn, key_cache, value_cache, table, starts, ctx,
                                                  dim ** -0.5), None, "bounded memory; speed for information")

    print(f"\ndevice: {device} ({torch.cuda.get_device_name(device) if on_gpu else 'CPU'}), dtype {dtype}, "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"{'path':44} {'shape':16} {'reference ms':>13} {'fast ms':>10} {'ratio':>7}  goal")
    for name, shape, r, f, goal, scope in rows:
        verdict = "" if goal is None else ("met" if r / f >= goal else "NOT met")
        print(f"{name:44} {shape:16} {r * 1e3:13.2f} {f * 1e3:10.2f} {r / f:6.2f}x  {scope} {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
