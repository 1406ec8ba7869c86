"""Run by the CPU runtime's Python with a patched vendor root first on sys.path (see test_preflight.py): the
adapter's blocks (its files at the flagship's pin) with their weights held and loaded by vLLM's own layers
(FusedMoE and its weight_loader, default_weight_loader), prefill then decode, every native switch off and on.
Prints one JSON object: per switch, the largest difference between the two and whether the native path is what
ran (profiling record).
"""

import atexit
import json
import os
import shutil
import sys
import tempfile
import types

import runtime_shims
import torch

# fixed path names to look for; the profile written at exit goes to a folder of its own
os.environ.update(TOOLKIT_PROFILE="1", MOE_SMALL_BATCH_VARIANT="segments",
                  TOOLKIT_PROFILE_DIR=tempfile.mkdtemp(prefix="runtime-adapter-profile-"))
# registered before the profiler's own exit hook, so it runs after the profile is written
atexit.register(shutil.rmtree, os.environ["TOOLKIT_PROFILE_DIR"], True)


def compare(name, call, profile_name, results):
    from native_fastpaths import profiling

    outputs = {}
    ran = {}
    for switch in ("0", "1"):
        os.environ[name] = switch
        profiling.reset()
        with torch.no_grad():
            outputs[switch] = call()
        ran[switch] = profile_name in profiling.native_paths()
    diffs = [float((a.double() - b.double()).abs().max()) for a, b in zip(outputs["0"], outputs["1"], strict=True)]
    results[name] = {"max_abs_diff": max(diffs), "native_ran_when_on": ran["1"], "native_ran_when_off": ran["0"],
                     "smallest_output": min(float(o.double().abs().max()) for o in outputs["0"])}


def main():
    runtime_shims.distributed()
    from vllm.model_executor.layers.fused_moe import FusedMoE
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm.model_executor.models import qwen3_5

    g = torch.Generator().manual_seed(0)
    results = {}

    experts, top_k, hidden, inter = 8, 2, 16, 6
    # the adapter's block takes the text config; it keeps vLLM's FusedMoE for the experts' storage and loading
    text_cfg = types.SimpleNamespace(hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k,
                                     moe_intermediate_size=inter, shared_expert_intermediate_size=inter)
    block = qwen3_5.Qwen3_5MoeSparseBlock(text_cfg)
    assert isinstance(block.experts, FusedMoE)
    for e in range(experts):  # an HF checkpoint's per-expert tensors, through vLLM's own loader
        for shard, shape in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter))):
            param = block.experts.w2_weight if shard == "w2" else block.experts.w13_weight
            block.experts.weight_loader(param, torch.randn(*shape, generator=g) / 4, f"experts.{e}.{shard}.weight",
                                        shard_id=shard, expert_id=e)
    prefill_x, decode_x = torch.randn(5, hidden, generator=g), torch.randn(1, hidden, generator=g)
    prefill_r, decode_r = torch.randn(5, experts, generator=g), torch.randn(1, experts, generator=g)
    compare("MOE_NATIVE", lambda: (block._pure_pytorch_experts(prefill_x, prefill_r),
                                   block._pure_pytorch_experts(decode_x, decode_r)), "moe.segments", results)

    norm = qwen3_5.Qwen3_5RMSNormGated(12)
    default_weight_loader(norm.weight, torch.rand(12, generator=g) + 0.5)
    rows = torch.randn(40, 12, generator=g)
    compare("RMSNORM_NATIVE", lambda: (norm(rows, rows * 2), norm(rows[:4], rows[:4] - 1)), "norm.gated",
            results)

    # the adapter's caller repeats the key heads to the value heads' count before it calls the rule
    q, k = torch.randn(1, 71, 2, 8, generator=g), torch.randn(1, 71, 2, 8, generator=g)
    q, k = q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2)
    v = torch.randn(1, 71, 4, 12, generator=g)
    gate, beta = -torch.rand(1, 71, 4, generator=g), torch.rand(1, 71, 4, generator=g)
    state0 = torch.zeros(1, 4, 8, 12)

    def prefill_then_decode():
        out, state = qwen3_5._torch_chunk_gated_delta_rule(
            q[:, :70], k[:, :70], v[:, :70], gate[:, :70], beta[:, :70], initial_state=state0.clone(),
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        step, final = qwen3_5._torch_chunk_gated_delta_rule(
            q[:, 70:], k[:, 70:], v[:, 70:], gate[:, 70:], beta[:, 70:], initial_state=state.clone(),
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        return out, step, final

    compare("CHUNK_PARALLEL", prefill_then_decode, "gdn.chunk", results)

    # the adapter's MambaCacheManager over memory that held NaN (an allocator's reuse): the state it hands out
    from vllm.model_executor.models import mamba_cache

    real_torch, mamba_cache.torch = mamba_cache.torch, runtime_shims.PoisonedTorch()
    try:
        manager = mamba_cache.MambaCacheManager(torch.float32, 2, 3, (6, 3), (4, 8, 12))
    finally:
        mamba_cache.torch = real_torch
    results["MAMBA_CACHE"] = {"finite": all(bool(torch.isfinite(t).all()) for t in manager.mamba_cache)}

    # vLLM's own linear layer: in the vendor tree its forward calls ixformer.functions.linear (stood in, mapped)
    from vllm.model_executor.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(12, 7, bias=True, params_dtype=torch.float32)
    default_weight_loader(layer.weight, torch.randn(7, 12, generator=g))
    default_weight_loader(layer.bias, torch.randn(7, generator=g))
    with torch.no_grad():
        got, _ = layer(rows)
        want = rows.double() @ layer.weight.double().t() + layer.bias.double()
    results["LINEAR"] = {"max_abs_diff": float((got.double() - want).abs().max()),
                         "smallest_output": float(want.abs().max())}
    json.dump(results, sys.__stdout__)


if __name__ == "__main__":
    sys.stdout = sys.stderr
    main()
