"""toolkit.estimate: the scheduler simulation against timelines worked by hand, the device model against a roofline
worked by hand."""

from __future__ import annotations

import pytest

from toolkit.estimate.device import Calibration, Device, Op, breakdown, seconds
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
    assert breakdown([matmul, reduce, matmul], BI_V100, FITTED) == pytest.approx(
        {"mlp": 2 * (10e-6 + weights / 600e9), "moe": 100e-6 + 1.5 * 4096 / 32e9})


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
