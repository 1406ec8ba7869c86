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
