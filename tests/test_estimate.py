"""toolkit.estimate: the scheduler simulation against timelines worked by hand, the device model against a roofline
worked by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolkit.errors import ToolkitError
from toolkit.estimate import calibrate
from toolkit.estimate.count import Counted, CountedStep
from toolkit.estimate.device import Calibration, Device, Op, seconds
from toolkit.estimate.predict import StepCost, regions
from toolkit.estimate.predict import requests as predict_requests
from toolkit.estimate.schedule import Chunk, Limits, Request, Step, simulate

ONE_SECOND = lambda step: 1.0  # noqa: E731 - every step the same, so the timeline counts steps


def test_a_long_prompt_is_chunked_by_the_budget_and_its_first_token_ends_the_last_chunk() -> None:
    timeline = simulate([[Request(prompt_tokens=10_000, max_tokens=3)]], Limits(8192, 2), ONE_SECOND)
    [record] = timeline.records
    assert [s.prefills for s in timeline.steps[:2]] == [(Chunk(8192, 0),), (Chunk(1808, 8192),)]
    assert [s.decodes for s in timeline.steps[2:]] == [(10_001,), (10_002,)]
    assert (record.ttft, record.e2e, record.completion_tokens, timeline.wall_s) == (2.0, 4.0, 3, 4.0)


def test_running_sequences_come_first_and_a_new_prefill_takes_the_budget_left() -> None:
    """Two clients at once: A's prompt fills step 1; step 2 finishes A's prompt and starts B's with what is left;
    step 3 decodes A beside the rest of B's prompt, less A's one token."""
    a, b = Request(prompt_tokens=10_000, max_tokens=2), Request(prompt_tokens=9_000, max_tokens=2)
    timeline = simulate([[a], [b]], Limits(8192, 2), ONE_SECOND)
    steps = timeline.steps
    assert steps[0] == Step((), (Chunk(8192, 0),))
    assert steps[1] == Step((), (Chunk(1808, 8192), Chunk(6384, 0)))
    assert steps[2] == Step((10_001,), (Chunk(2616, 6384),))
    assert steps[3] == Step((9_001,), ())
    first, second = timeline.records
    assert (first.ttft, first.e2e) == (2.0, 3.0) and (second.ttft, second.e2e) == (3.0, 4.0)


def test_a_cache_hit_skips_its_tokens_and_a_fully_cached_prompt_still_computes_its_last() -> None:
    hit = simulate([[Request(prompt_tokens=6_639, max_tokens=1, cached_tokens=4_416)]], Limits(8192, 2), ONE_SECOND)
    assert hit.steps == [Step((), (Chunk(2_223, 4_416),))]
    whole = simulate([[Request(prompt_tokens=512, max_tokens=1, cached_tokens=512)]], Limits(8192, 2), ONE_SECOND)
    assert whole.steps == [Step((), (Chunk(1, 511),))]


def test_a_client_sends_its_next_request_when_the_last_ends_and_max_num_seqs_holds() -> None:
    turn = Request(prompt_tokens=100, max_tokens=2)
    timeline = simulate([[turn, turn], [turn], [turn]], Limits(8192, 2), lambda step: 0.5)
    assert max(len(s.decodes) + len(s.prefills) for s in timeline.steps) == 2
    first, third = timeline.records[0], next(r for r in timeline.records if r.worker == 0 and r.request_id != "r0")
    assert third.t0 == first.t0 + first.e2e  # no think time between a client's requests
    assert len(timeline.records) == 4 and all(r.ok for r in timeline.records)


def test_without_chunked_prefill_a_step_prefills_whole_prompts_that_fit_and_decodes_nothing_beside_them() -> None:
    """vLLM 0.6.3's default policy: A and B's prompts fit the 160-token budget together, C's does not; then the two
    decode (C waits: max-num-seqs is 2); B ends, C's prompt runs alone; A's third token comes beside C's second."""
    a, b, c = Request(100, 3), Request(50, 2), Request(70, 2)
    timeline = simulate([[a], [b], [c]], Limits(160, 2, chunked=False), ONE_SECOND)
    assert timeline.steps == [Step((), (Chunk(100, 0), Chunk(50, 0))), Step((101, 51), ()),
                              Step((), (Chunk(70, 0),)), Step((102, 71), ())]
    with pytest.raises(RuntimeError, match="does not fit --max-num-batched-tokens 160 without chunked prefill"):
        simulate([[Request(200, 1)]], Limits(160, 2, chunked=False), ONE_SECOND)


def test_a_request_needs_a_prompt_and_a_budget_that_admits_a_token() -> None:
    with pytest.raises(ValueError, match="cached tokens"):
        Request(prompt_tokens=10, max_tokens=1, cached_tokens=11)
    with pytest.raises(ValueError, match="budget"):
        Limits(0, 2)


BI_V100 = Device(bandwidth_gbs=1200, peak_tflops={"bfloat16": 147, "float32": 37}, link_gbs=32, ranks=4)
FITTED = Calibration(launch_us=10, bandwidth_fraction=0.5, compute_fraction=0.5, all_reduce_us=100)


def test_an_operation_costs_a_launch_and_the_longer_of_its_compute_and_its_traffic() -> None:
    # a decode token's 2048 x 4096 bf16 matmul: 16.8 MB of weights at 600 GB/s = 27.96 us, 16.8 MFLOP at 73.5
    # TFLOP/s = 0.23 us: memory-bound, 37.96 us with the launch
    weights = 2048 * 4096 * 2
    matmul = Op("linear", "mlp", flops=2 * 2048 * 4096, bytes=weights, dtype="bfloat16")
    assert seconds(matmul, BI_V100, FITTED) == pytest.approx(10e-6 + weights / 600e9)
    # the same weights for 8192 tokens: 137 GFLOP at 73.5 TFLOP/s = 1.87 ms, compute-bound
    prefill = Op("linear", "mlp", flops=2 * 8192 * 2048 * 4096, bytes=weights, dtype="bfloat16")
    assert seconds(prefill, BI_V100, FITTED) == pytest.approx(10e-6 + 2 * 8192 * 2048 * 4096 / 73.5e12)
    # a TP all-reduce of one token's 2048 bf16 values over 4 cards: 100 us + 1.5 x 4096 B at 32 GB/s
    reduce = Op("all_reduce", "moe", flops=0, bytes=4096, dtype="bfloat16", collective=True)
    assert seconds(reduce, BI_V100, FITTED) == pytest.approx(100e-6 + 1.5 * 4096 / 32e9)
    one_card = Device(1200, {"bfloat16": 147}, 32, ranks=1)
    assert seconds(reduce, one_card, FITTED) == 0.0
    own = regions([matmul, reduce, matmul], BI_V100, FITTED)
    assert {name: entry["seconds"] for name, entry in own.items()} == pytest.approx(
        {"mlp": 2 * (10e-6 + weights / 600e9), "moe": 100e-6 + 1.5 * 4096 / 32e9})
    # an operation counted 3 times (FLOPs and bytes are the three calls') is three launches and one roofline
    thrice = Op("linear", "mlp", flops=3 * 2 * 2048 * 4096, bytes=3 * weights, dtype="bfloat16", calls=3)
    assert seconds(thrice, BI_V100, FITTED) == pytest.approx(3 * (10e-6 + weights / 600e9))
    # index arithmetic is priced at the fp32 peak (the figures give none for integers)
    index = Op("index", "moe", flops=37e6, bytes=0, dtype="int64")
    assert seconds(index, BI_V100, FITTED) == pytest.approx(10e-6 + 37e6 / 18.5e12)


def test_a_dtype_without_a_peak_is_refused_with_the_field_to_add() -> None:
    from toolkit.errors import ToolkitError

    with pytest.raises(ToolkitError, match="no peak for float16") as error:
        seconds(Op("linear", "mlp", 1, 1, "float16"), BI_V100, FITTED)
    assert "hardware.peak_tflops" in (error.value.hint or "")
    with pytest.raises(ValueError, match="fractions"):
        Calibration(launch_us=1, bandwidth_fraction=1.5, compute_fraction=0.5, all_reduce_us=0)


def test_the_image_layer_gives_the_bi_v100s_public_figures() -> None:
    from conftest import FLAGSHIP

    from toolkit.errors import ToolkitError
    from toolkit.estimate.device import device_of
    from toolkit.recipe import load_recipe

    hardware = load_recipe(FLAGSHIP).recipe.hardware
    assert device_of(hardware, 4) == Device(1200, {"bfloat16": 147, "float16": 147, "float32": 37}, 32, 4)
    with pytest.raises(ToolkitError, match="gives no bandwidth_gbs, peak_tflops, link_gbs"):
        device_of(hardware.model_copy(update={"bandwidth_gbs": None, "peak_tflops": None, "link_gbs": None}), 4)


def _step(decodes: tuple[int, ...], prefills: tuple[int, ...], launches: float, rank_one: float = 0) -> CountedStep:
    """A counted step of `launches` one-byte kernels on rank 0 (and `rank_one` on rank 1)."""
    step = CountedStep(decodes, prefills)
    step.ranks[0] = [Op("k", "step.model_forward.layer.moe", 0, launches, "bfloat16", calls=launches)]
    step.ranks[1] = [Op("k", "step.model_forward.layer.moe", 0, rank_one or 1, "bfloat16", calls=rank_one or 1)]
    return step


def test_a_step_is_priced_from_the_counted_shapes_nearest_it_on_its_slowest_rank(tmp_path: Path) -> None:
    counted = Counted([_step((), (16,), 100), _step((), (256,), 400), _step((33, 33), (), 50, rank_one=60),
                       _step((33,), (), 40), _step((34,), (), 30), _step((35,), (), 35),
                       _step((), (16, 16), 1000)], tmp_path, [])
    cost = StepCost(counted, BI_V100, Calibration(launch_us=10, bandwidth_fraction=1, compute_fraction=1,
                                                  all_reduce_us=0))
    launch = 10e-6 + 1 / 1200e9  # a one-byte kernel
    # each rank's cheapest count of a shape (a path's first call may do one-off work), then the slowest rank; a
    # joint prefill of two prompts prices nothing
    assert [b for b, _ in cost.decode_points] == [1.0, 2.0]
    assert [s for _, s in cost.decode_points] == pytest.approx([30 * launch, 60 * launch])
    assert cost(Step((500,) * 4, ())) == pytest.approx(120 * launch)  # extended along the last segment
    # a prefill between two counted lengths is linear in its tokens; a mixed step's decodes count as its tokens
    assert cost(Step((), (Chunk(136, 0),))) == pytest.approx(250 * launch)
    assert cost(Step((70, 70), (Chunk(134, 0),))) == pytest.approx(250 * launch)


def test_prompts_are_dealt_to_clients_and_a_shared_prefix_hits_only_once_its_first_request_ran() -> None:
    from toolkit.bench import workloads

    tools = predict_requests(workloads.tools(4), concurrency=2, max_tokens=64)
    first_round = [client[0] for client in tools]
    later = [client[1] for client in tools]
    assert [r.cached_tokens for r in first_round] == [0, 0]  # both clients' first prefills run together
    assert all(r.cached_tokens > 1000 and r.cached_tokens % 16 == 0 for r in later)  # the 29 schemas, whole blocks
    assert all(r.cached_tokens < r.prompt_tokens and r.max_tokens == 64 for r in later)
    short = predict_requests(workloads.short(4), concurrency=1, max_tokens=8)
    assert [r.cached_tokens for r in short[0]] == [0, 0, 0, 0]  # distinct from their first word


def test_the_fit_recovers_the_constants_that_made_the_measured_times(tmp_path: Path) -> None:
    """Per-call times made from known constants with a counted step (launch-bound small kernels, a memory-bound
    weight read, a collective, and timed regions' synchronisations) are what the fit reproduces."""
    step = CountedStep((65,), ())
    layer = "step.model_forward.layer"
    step.ranks[0] = [
        Op("small", f"{layer}.gdn", 0, 3e5, "float32", calls=650),
        Op("weights", f"{layer}.moe.routed", 2e8, 4e8, "bfloat16", calls=40),
        Op("small", f"{layer}.moe.routed", 0, 1e5, "float32", calls=400),
        Op("reduce", f"{layer}.moe.all_reduce", 0, 40 * 4096, "bfloat16", collective=True, calls=40),
        Op("small", f"{layer}.attention", 0, 1e5, "float32", calls=300),
        Op("lm_head", "step.compute_logits", 1e9, 2.5e8, "bfloat16", calls=1),
    ]
    entries = {"step.model_forward": 1.0, f"{layer}.gdn": 30.0, f"{layer}.moe": 40.0, f"{layer}.moe.routed": 40.0,
               f"{layer}.moe.all_reduce": 40.0, f"{layer}.attention": 10.0, "step.compute_logits": 1.0}
    truth = Calibration(launch_us=25, bandwidth_fraction=0.3, compute_fraction=calibrate.COMPUTE_FRACTION,
                        all_reduce_us=80)
    timed = frozenset(entries)
    truths = calibrate._predicted(step, entries, BI_V100, truth, 150.0, list(entries), timed)
    made = [calibrate.Measured(region, truths[region] * 1e3, calls) for region, calls in entries.items()]
    # the synchronises a region's clock sees: its own end, and both ends of each timed region inside it (the MoE
    # block: 1 + 2 x (routed + all-reduce) = 5 a call)
    moe = f"{layer}.moe"
    synced, bare = (calibrate._predicted(step, entries, BI_V100, truth, sync, [moe], timed)[moe]
                     for sync in (100.0, 0.0))
    assert synced - bare == pytest.approx(5 * 100e-6)
    fitted = calibrate.fit(step, entries, BI_V100, made, "made")
    assert fitted.spread < 1.02
    assert fitted.calibration.launch_us == pytest.approx(25, rel=0.05)
    assert fitted.calibration.bandwidth_fraction == pytest.approx(0.3, rel=0.05)
    assert fitted.sync_us == pytest.approx(150, rel=0.05)
    assert fitted.calibration.all_reduce_us == pytest.approx(80, rel=0.05)
    written = tmp_path / "calibration.yaml"
    written.write_text(fitted.as_yaml(), encoding="utf-8")
    again = calibrate.read(written)
    assert again.calibration == fitted.calibration and again.regions == fitted.regions
    with pytest.raises(ToolkitError, match="match the counted step's regions"):
        calibrate.fit(step, entries, BI_V100, [calibrate.Measured("step.other", 1.0, 1)], "made")
