"""toolkit.runtime.census: what a step dispatches, counted by rule, against a small module counted by hand."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from toolkit.bench.serve import free_port
from toolkit.estimate.device import AllReduce, Calibration, Device, Op, seconds
from toolkit.runtime import census as census_module
from toolkit.runtime import standins

torch = pytest.importorskip("torch")


def _rank_step(rank: int, port: int, folder: str) -> None:
    """One rank of TP 2: a linear, a norm, then the vendor's all-reduce (the stand-in's CPU reference, on gloo)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    regions: list[tuple[str, str]] = []
    census = census_module.Census(lambda: regions[-1] if regions else None, census_module._writer(folder))
    standins.call_references_through(census.vendor)
    x = torch.ones(4, 64, dtype=torch.bfloat16)
    weight, bias = torch.ones(128, 64, dtype=torch.bfloat16), torch.ones(128, dtype=torch.bfloat16)
    scale = torch.ones(128)
    table, ids = torch.ones(1000, 64, dtype=torch.bfloat16), torch.tensor([1, 5, 7, 9])
    regions.append(("decode", "step"))
    census.start()
    regions.append(("decode", "step.embed"))
    F.embedding(ids, table)
    regions[-1] = ("decode", "step.linear")
    y = F.linear(x, weight, bias)
    regions[-1] = ("decode", "step.norm")
    h = y.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * scale
    regions[-1] = ("decode", "step.all_reduce")
    group = standins.standin("ixformer.contrib.torch.extension.ixformer_torch.distributed."
                             "create_ixformer_group_from_pg")(dist.group.WORLD)
    standins.standin("ixformer.distributed.all_reduce")(h, group=group)
    regions.pop()
    census.stop()
    dist.destroy_process_group()


def test_a_linear_a_norm_and_an_all_reduce_at_tp_2_are_counted_as_by_hand(tmp_path: Path) -> None:
    port = free_port()
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=_rank_step, args=(rank, port, str(tmp_path))) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(60)
        if process.is_alive():
            process.kill()
        assert process.exitcode == 0
    lines = census_module.read(tmp_path)
    assert sorted(line["rank"] for line in lines) == [0, 1]
    for line in lines:
        ops: dict[tuple[str, str], tuple[str, str, int, float, float]] = {}
        for region, op, dtype, kind, _, calls, flops, nbytes in line["ops"]:  # each shape's row, summed
            _, _, n, f, b = ops.get((region, op), (dtype, kind, 0, 0.0, 0.0))
            ops[(region, op)] = (dtype, kind, n + calls, f + flops, b + nbytes)
        shapes = {(region, op): shape for region, op, _, _, shape, *_ in line["ops"]}
        assert len(line["ops"]) == 10  # the two products have two shapes
        assert shapes[("step.embed", "aten.embedding")] == "1000x64,4"
        assert shapes[("step.linear", "aten.addmm")] == "128,4x64"  # the bias, the input (the weight is third)
        bf16, f32 = 2, 4
        # the embedding reads the 4 rows it writes (not the table) and the ids
        assert ops[("step.embed", "aten.embedding")] == ("bfloat16", "kernel", 1, 4 * 64, (2 * 4 * 64) * bf16 + 4 * 8)
        # the linear: one addmm (the transpose of the weight is a view), 2 m k n FLOPs, the bias, the input, the
        # weight and the output read or written once
        assert ops[("step.linear", "aten.addmm")] == (
            "bfloat16", "kernel", 1, 2 * 4 * 64 * 128, (128 + 4 * 64 + 128 * 64 + 4 * 128) * bf16)
        # the norm: the cast, the square, the mean, + eps, rsqrt, two products; one FLOP an output element
        rows = 4 * 128
        assert ops[("step.norm", "aten._to_copy")] == ("float32", "kernel", 1, rows, rows * (bf16 + f32))
        assert ops[("step.norm", "aten.pow")] == ("float32", "kernel", 1, rows, 2 * rows * f32)
        assert ops[("step.norm", "aten.mean")] == ("float32", "kernel", 1, 4, (rows + 4) * f32)
        assert ops[("step.norm", "aten.add")] == ("float32", "kernel", 1, 4, 2 * 4 * f32)
        assert ops[("step.norm", "aten.rsqrt")] == ("float32", "kernel", 1, 4, 2 * 4 * f32)
        # h * rsqrt (the rows, the 4 scales, the product), then * scale (the product, the 128 weights, the result)
        assert ops[("step.norm", "aten.mul")] == ("float32", "kernel", 2, 2 * rows,
                                                  ((rows + 4 + rows) + (rows + 128 + rows)) * f32)
        # the all-reduce: one collective of its buffer, no FLOPs, and neither gloo's transport nor the group handle
        # counted beside it
        assert ops[("step.all_reduce", "ixformer.distributed.all_reduce")] == (
            "float32", "collective", 1, 0.0, rows * f32)
        assert len(ops) == 9
    # priced: a ring moves 2 (n - 1) / n of the buffer at its implementation's rate after its latency: 1 of it at
    # TP 2, 1.5 at 4
    calibration = Calibration(launch_us=5, bandwidth_fraction=1, compute_fraction=1,
                              all_reduce={"nccl": AllReduce(latency_us=20, gbs=1)})
    op = Op("ixformer.distributed.all_reduce", "step.all_reduce", 0, rows * f32, "float32", collective=True)
    for ranks, share in ((2, 1.0), (4, 1.5)):
        device = Device(bandwidth_gbs=1000, peak_tflops={"float32": 10}, link_gbs=1, ranks=ranks)
        assert seconds(op, device, calibration) == pytest.approx(20e-6 + share * rows * f32 / 1e9)


def test_the_switch_is_off_unset_and_a_relative_folder_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    assert census_module.from_environment({}) is None
    with pytest.raises(census_module.CensusError, match="not an absolute folder"):
        census_module.from_environment({census_module.ENV: "census"})


def _paged_step(blocks: int, folder: Path) -> dict[str, tuple[int, float]]:
    """One decode token written into the paged cache and attended over a 40-token context, by the vendor's calls
    (their CPU references), in a cache of `blocks` blocks: each call's (calls, bytes)."""
    regions = [("decode", "step")]
    census = census_module.Census(lambda: regions[-1], census_module._writer(str(folder)))
    standins.call_references_through(census.vendor)
    kv_heads, size, x, block = 2, 64, 8, 16
    key_cache = torch.zeros(blocks, kv_heads, size // x, block, x, dtype=torch.float16)
    value_cache = torch.zeros(blocks, kv_heads, size, block, dtype=torch.float16)
    key, value = torch.ones(1, kv_heads, size, dtype=torch.float16), torch.ones(1, kv_heads, size, dtype=torch.float16)
    query, output = torch.ones(1, 4, size, dtype=torch.float16), torch.empty(1, 4, size, dtype=torch.float16)
    table = torch.tensor([[3, 1, 2]], dtype=torch.int32)  # 40 tokens: two full blocks and 8 of a third
    census.start()
    standins.standin("ixformer.functions.vllm_cache_ops_reshape_and_cache")(
        key, value, key_cache, value_cache, torch.tensor([2 * block + 7]))
    standins.standin("ixformer.functions.vllm_single_query_cached_kv_attention")(
        output, query, key_cache, value_cache, torch.tensor([0, 0, 1, 1]), 0.125, table, torch.tensor([40]), block,
        40)
    census.stop()
    standins.call_references_through(None)
    (line,) = census_module.read(folder)
    return {op: (calls, nbytes) for _, op, _, _, _, calls, _, nbytes in line["ops"]}


def test_the_vendors_paged_calls_are_priced_by_the_blocks_they_touch_not_the_caches_size(tmp_path: Path) -> None:
    """The census sizes the KV cache for its deepest context: the cache write and the decode's attention move a
    token's keys and a sequence's context whatever the cache holds."""
    small, large = _paged_step(8, tmp_path / "small"), _paged_step(4096, tmp_path / "large")
    assert small == large
    half = 2
    write, attend = (large[f"ixformer.functions.{name}"] for name in (
        "vllm_cache_ops_reshape_and_cache", "vllm_single_query_cached_kv_attention"))
    token = 2 * 64 * half  # one token's keys (or values) over its two KV heads
    # the write reads the token's keys and values and writes them into their slot (and reads the slot index)
    assert write[0] == 1 and 4 * token <= write[1] < 4 * token + 64
    # the attention reads the 40 context tokens' keys and values (not the cache), the query, and writes the output
    # (and reads its small index tensors: the block table, the lengths, the head mapping)
    moved = 2 * 40 * token + 2 * 4 * 64 * half
    assert attend[0] == 1 and moved <= attend[1] < moved + 1024
