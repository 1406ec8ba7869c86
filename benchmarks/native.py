"""Native fast paths vs what they replace, at the real model's shapes, in one run.

Qwen3.6-35B-A3B: hidden 2048, 256 experts, top-k 8, expert intermediate 512; GatedDeltaNet per card at TP=4:
8 value heads of 128 (q/k already expanded to them, as the adapter calls it). The references are faithful
re-implementations of the adapter's own code (tests/adapter_reference.py, checked equal in tests/test_native.py).
Each row times the reference and the fast path on the same inputs, alternating, and prints the ratio
(reference / fast: above 1 means the fast path is faster).

    python benchmarks/native.py                 # CPU, fp32
    python benchmarks/native.py --device cuda   # GPU, bf16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "patches" / "src"))
sys.path.insert(0, str(ROOT / "tests"))
from adapter_reference import adapter_chunk_gated_delta_rule, adapter_pure_pytorch_experts  # noqa: E402
from native_fastpaths import gdn, moe, norm, prefix_attention  # noqa: E402

HIDDEN, EXPERTS, TOP_K, INTER = 2048, 256, 8, 512
HK, HV, DK, DV = 16, 32, 128, 128
HV_CARD = 8  # value heads per card at TP=4
MOE_TOKENS = (1, 2, 3, 4, 8, 16, 64, 1024)


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


def timed_many(fns: dict[str, Callable[[], object]], device: torch.device, repeat: int) -> dict[str, float]:
    """Medians of round-robin runs (the order rotates), so drift in the machine's load hits every side alike."""
    for fn in fns.values():
        fn()  # warm-up
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeat):
        for name in names[i % len(names):] + names[:i % len(names)]:
            times[name].append(once(fns[name], device))
    return {name: statistics.median(t) for name, t in times.items()}


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

    moe_rows: list[tuple[int, str, float, float, str]] = []

    def bench_moe() -> None:  # a function of its own so the 3 GB of expert weights are freed after it
        w13 = rand(EXPERTS, 2 * INTER, HIDDEN, scale=0.02)
        w2 = rand(EXPERTS, HIDDEN, INTER, scale=0.02)
        os.environ.pop("MOE_SMALL_BATCH_VARIANT", None)  # auto, the default

        def routed(path: Callable[..., torch.Tensor], hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            return path(hidden, w13, w2, *moe.route(logits, TOP_K))  # the router is part of what is replaced

        os.environ.pop("MOE_SMALL_BATCH_THRESHOLD", None)
        for tokens in MOE_TOKENS:
            hidden, logits = rand(tokens, HIDDEN), rand(tokens, EXPERTS)
            fns: dict[str, Callable[[], object]] = {
                "adapter": partial(adapter_pure_pytorch_experts, hidden, w13, w2, logits, TOP_K)}
            within = tokens <= int(moe.switches.small_batch_threshold())
            for name in moe._bucket(tokens)[1] if within else ("segments",):
                fns[name] = partial(routed, moe.SMALL_BATCH[name], hidden, logits)
            before = len(moe.measurements)
            moe.experts(hidden, w13, w2, logits, TOP_K)  # auto measures its bucket here, once
            record = moe.measurements[before] if len(moe.measurements) > before else None
            fns["auto"] = partial(moe.experts, hidden, w13, w2, logits, TOP_K)
            result = timed_many(fns, device, args.repeat)
            chosen = f"{moe.chosen(device, dtype, tokens)}" + ("" if within else " (above the small-batch threshold)")
            cost = (f"; measured this bucket in {record['cost_ms']} ms" if record
                    else "; bucket measured before" if within else "")
            for name, seconds in result.items():
                if name != "adapter":
                    moe_rows.append((tokens, name, result["adapter"], seconds,
                                     f"auto chose {chosen}{cost}" if name == "auto" else ""))
            print(f"  measured moe {tokens} tok: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in result.items()),
                  file=sys.stderr, flush=True)

    bench_moe()

    n = args.gdn_tokens
    q, k = rand(1, n, HV_CARD, DK), rand(1, n, HV_CARD, DK)  # already expanded to the value heads
    v = rand(1, n, HV_CARD, DV)
    gate = -torch.rand(1, n, HV_CARD, generator=g).to(device) * 0.1
    beta = torch.rand(1, n, HV_CARD, generator=g).to(device)
    state0 = torch.randn(1, HV_CARD, DK, DV, generator=g).to(device) * 0.01
    call = dict(initial_state=state0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    row("gdn chunked prefill vs adapter", f"{n} tok x {HV_CARD} h",
        lambda: adapter_chunk_gated_delta_rule(q, k, v, gate, beta, **call),
        lambda: gdn.torch_chunk_gated_delta_rule(q, k, v, gate, beta, **call), 2.0, ">=2x", repeat=6)
    state = torch.zeros(1, HV_CARD, DK, DV, device=device)
    q1, k1, v1, g1, b1 = q[:, :1], k[:, :1], v[:, :1], gate[:, :1], beta[:, :1]
    row("gdn one-step recurrence vs chunked(1 tok)", "1 tok",
        lambda: gdn.chunk_gated_delta_rule(q1, k1, v1, g1, b1, initial_state=state, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True),
        lambda: gdn.recurrent_gated_delta_rule(q1, k1, v1, g1, b1, initial_state=state, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True), None, "for information", repeat=20)

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
    print("\nMoE routed experts (router included) vs the adapter's _pure_pytorch_experts")
    print(f"{'tokens':>6} {'path':10} {'adapter ms':>11} {'path ms':>10} {'ratio':>7}  goal")
    for tokens, name, r, f, extra in moe_rows:
        goal = ""
        if name == "auto":
            want = 1.5 if 2 <= tokens <= 16 else 1.0
            goal = f">={want}x {'met' if r / f >= want * 0.9 else 'NOT met'} (10% noise allowed); {extra}"
        print(f"{tokens:6d} {name:10} {r * 1e3:11.2f} {f * 1e3:10.2f} {r / f:6.2f}x  {goal}")
    print(f"\n{'path':44} {'shape':16} {'reference ms':>13} {'fast ms':>10} {'ratio':>7}  goal")
    for name, shape, r, f, goal, scope in rows:
        verdict = "" if goal is None else ("met" if r / f >= goal else "NOT met")
        print(f"{name:44} {shape:16} {r * 1e3:13.2f} {f * 1e3:10.2f} {r / f:6.2f}x  {scope} {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
