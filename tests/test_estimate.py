"""toolkit.estimate: the scheduler simulation against timelines worked by hand, the device model against a roofline
worked by hand."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from toolkit.errors import ToolkitError
from toolkit.estimate import calibrate
from toolkit.estimate.count import Counted, CountedStep
from toolkit.estimate.device import AllReduce, Calibration, Device, Op, all_reduce_of, seconds
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
NCCL = {"nccl": AllReduce(latency_us=100, gbs=32)}
FITTED = Calibration(launch_us=10, bandwidth_fraction=0.5, compute_fraction=0.5, all_reduce=NCCL)


def test_an_operation_costs_a_launch_and_the_longer_of_its_compute_and_its_traffic() -> None:
    # a decode token's 2048 x 4096 bf16 matmul: 16.8 MB of weights at 600 GB/s = 27.96 us, 16.8 MFLOP at 73.5
    # TFLOP/s = 0.23 us: memory-bound, 37.96 us with the launch
    weights = 2048 * 4096 * 2
    matmul = Op("linear", "mlp", flops=2 * 2048 * 4096, bytes=weights, dtype="bfloat16")
    assert seconds(matmul, BI_V100, FITTED) == pytest.approx(10e-6 + weights / 600e9)
    # the same weights for 8192 tokens: 137 GFLOP at 73.5 TFLOP/s = 1.87 ms, compute-bound
    prefill = Op("linear", "mlp", flops=2 * 8192 * 2048 * 4096, bytes=weights, dtype="bfloat16")
    assert seconds(prefill, BI_V100, FITTED) == pytest.approx(10e-6 + 2 * 8192 * 2048 * 4096 / 73.5e12)
    # a TP all-reduce of one token's 2048 bf16 values over 4 cards (NCCL, the device's default): 100 us + 1.5 x 4096 B
    # at its 32 GB/s
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
        Calibration(launch_us=1, bandwidth_fraction=1.5, compute_fraction=0.5)
    with pytest.raises(ValueError, match="custom: not one of nccl, ixformer-ipc"):
        Calibration(launch_us=1, bandwidth_fraction=0.5, compute_fraction=0.5, all_reduce={"custom": NCCL["nccl"]})


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
    cost = StepCost(counted, BI_V100, Calibration(launch_us=10, bandwidth_fraction=1, compute_fraction=1))
    launch = 10e-6 + 1 / 1200e9  # a one-byte kernel
    # each rank's cheapest count of a shape (a path's first call may do one-off work), then the slowest rank; a
    # joint prefill of two prompts prices nothing
    assert [b for b, _ in cost.decode_points] == [1.0, 2.0]
    assert [s for _, s in cost.decode_points] == pytest.approx([30 * launch, 60 * launch])
    assert cost(Step((500,) * 4, ())) == pytest.approx(120 * launch)  # extended along the last segment
    # a prefill between two counted lengths is linear in its tokens; a mixed step's decodes count as its tokens
    assert cost(Step((), (Chunk(136, 0),))) == pytest.approx(250 * launch)
    assert cost(Step((70, 70), (Chunk(134, 0),))) == pytest.approx(250 * launch)


def test_a_steps_contexts_are_priced_from_the_counted_contexts(tmp_path: Path) -> None:
    """A decode at a context between two counted ones adds what one sequence's counted decodes there add over the
    short context, linearly; a chunk at a depth adds its counted chunk's extra per token, times its tokens; where the
    calibration has the target's measured decode against context, that prices the decodes (the chunks stay
    counted)."""
    from toolkit.estimate.device import DecodeContext

    def deep(step: CountedStep, depth: int) -> CountedStep:
        return dataclasses.replace(step, depth=depth)

    counted = Counted([_step((), (256,), 400), _step((), (2048,), 2000), _step((65,), (), 30),
                       _step((65, 65), (), 50),
                       # a context of 4,000: its 256-token chunk costs 40 launches more than a cold one; its decodes
                       # (the cheapest of two counts) 10 more than at 65
                       deep(_step((), (256,), 440), 4000), deep(_step((4257,), (), 45), 4000),
                       deep(_step((4258,), (), 40), 4000),
                       # 36,000: the chunk 400 more, the decode 100 more
                       deep(_step((), (256,), 800), 36000), deep(_step((36257,), (), 130), 36000)], tmp_path, [])
    calibration = Calibration(launch_us=10, bandwidth_fraction=1, compute_fraction=1)
    cost = StepCost(counted, BI_V100, calibration)
    launch = 10e-6 + 1 / 1200e9
    assert [x for x, _ in cost.context_points] == [4257, 36257]
    assert [t for _, t in cost.context_points] == pytest.approx([10 * launch, 100 * launch])
    assert cost(Step((65,), ())) == pytest.approx(30 * launch)
    assert cost(Step((20257,), ())) == pytest.approx((30 + 55) * launch)  # halfway between the counted contexts
    # two sequences: the batch's counted decode, and each one's context
    assert cost(Step((4257, 36257), ())) == pytest.approx((50 + 10 + 100) * launch)
    # a chunk of 512 tokens at 4,000: the cold 512 (between 256 and 2048) and twice the 256-token chunk's extra
    cold = 400 + (2000 - 400) * (512 - 256) / (2048 - 256)
    assert cost(Step((), (Chunk(512, 4000),))) == pytest.approx((cold + 2 * 40) * launch)
    assert cost(Step((), (Chunk(512, 0),))) == pytest.approx(cold * launch)
    measured = DecodeContext(32768, (0.04, 1e-8), (0.07, 1e-6))
    with_measured = StepCost(counted, BI_V100, dataclasses.replace(calibration, decode_context=measured))
    assert with_measured(Step((36257,), ())) == pytest.approx(30 * launch + measured.extra(36257, 65))
    assert with_measured(Step((), (Chunk(512, 4000),))) == pytest.approx((cold + 2 * 40) * launch)
    assert with_measured.decode_at(36257) == pytest.approx(130 * launch)  # the count, as checked against the figures


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
                        all_reduce={"nccl": AllReduce(80, 5)})
    timed = frozenset(entries)
    truths = calibrate._predicted(step, entries, BI_V100, truth, 150.0, list(entries), timed)
    made = [calibrate.Measured(region, truths[region] * 1e3, calls) for region, calls in entries.items()]
    # the synchronises a region's clock sees: its own end, and both ends of each timed region inside it (the MoE
    # block: 1 + 2 x (routed + all-reduce) = 5 a call)
    moe = f"{layer}.moe"
    synced, bare = (calibrate._predicted(step, entries, BI_V100, truth, sync, [moe], timed)[moe]
                     for sync in (100.0, 0.0))
    assert synced - bare == pytest.approx(5 * 100e-6)
    fitted = calibrate.fit(step, entries, BI_V100, made, "made", dict(truth.all_reduce))
    assert fitted.spread < 1.02 and fitted.unidentified == []
    assert fitted.calibration.launch_us == pytest.approx(25, rel=0.05)
    assert fitted.calibration.bandwidth_fraction == pytest.approx(0.3, rel=0.05)
    assert fitted.sync_us == pytest.approx(150, rel=0.05)
    written = tmp_path / "calibration.yaml"
    written.write_text(fitted.as_yaml(), encoding="utf-8")
    again = calibrate.read(written)
    assert again.calibration == fitted.calibration and again.regions == fitted.regions
    with pytest.raises(ToolkitError, match="match the counted step's regions"):
        calibrate.fit(step, entries, BI_V100, [calibrate.Measured("step.other", 1.0, 1)], "made", {})
    # a constant the records cannot decide ends at a bound of its range, and the calibration says so: regions
    # measured faster than any launch and any read leave the launch cost at its floor, the bandwidth at its peak
    fast = [calibrate.Measured(region, 1e-5, calls) for region, calls in entries.items()]
    stuck = calibrate.fit(step, entries, BI_V100, fast, "made", dict(truth.all_reduce))
    assert stuck.unidentified == ["launch_us", "bandwidth_fraction"]
    assert calibrate.to_json(stuck)["unidentified"] == stuck.unidentified


def test_the_variants_env_picks_its_all_reduce_and_ipc_off_is_a_slower_step(tmp_path: Path) -> None:
    """ENABLE_CUSTOM_IPC=1 prices a step's all-reduces as ixformer's IPC calls, anything else as NCCL's, with each
    implementation's constants decided by the target's calls at two buffer sizes."""
    assert all_reduce_of({"ENABLE_CUSTOM_IPC": "1"}) == "ixformer-ipc"
    assert all_reduce_of({}) == all_reduce_of({"ENABLE_CUSTOM_IPC": "0"}) == "nccl"
    with pytest.raises(ToolkitError, match="ENABLE_CUSTOM_IPC='yes': ixformer turns its IPC all-reduce on for 1"):
        all_reduce_of({"ENABLE_CUSTOM_IPC": "yes"})
    from conftest import REPO

    timings = REPO / "benchmarks" / "data" / "target-timings.yaml"
    reduces, _, checks = calibrate.timings(timings, ranks=4)
    # decided by 2,048 and 65,536 elements (float16); 8,192 is a prediction, kept beside them
    assert reduces["nccl"].latency_us == pytest.approx(226.1, abs=0.1)
    assert reduces["ixformer-ipc"].latency_us == pytest.approx(19.3, abs=0.1)
    for name, measured in (("nccl", 0.2270), ("ixformer-ipc", 0.0282)):
        check = checks["all_reduce"][name]["predicted"]["8192"]
        assert check["measured_ms"] == measured
        assert check["predicted_ms"] == pytest.approx(measured, rel=0.06)
    with pytest.raises(ToolkitError, match="timed at 4 ranks, the estimate runs 2"):
        calibrate.timings(timings, ranks=2)
    calibration = Calibration(launch_us=10, bandwidth_fraction=0.5, compute_fraction=0.5, all_reduce=reduces)
    layer = "step.model_forward.layer"
    step = CountedStep((65,), ())
    # a decode step's 80 all-reduces of one token's 2,048 half values, beside its other work
    step.ranks[0] = [Op("weights", f"{layer}.moe", 0, 4e8, "float16", calls=400),
                     Op("ixformer.distributed.all_reduce", f"{layer}.moe", 0, 80 * 4096, "float16",
                        collective=True, calls=80)]
    counted = Counted([step, CountedStep((), (16,), {0: step.ranks[0]})], tmp_path, [])
    ipc, nccl = (StepCost(counted, Device(1200, {"float16": 147}, 32, 4, all_reduce_of(env)), calibration)
                 for env in ({"ENABLE_CUSTOM_IPC": "1"}, {"ENABLE_CUSTOM_IPC": "0"}))
    slower = nccl(Step((65,), ())) - ipc(Step((65,), ()))
    assert slower == pytest.approx(80 * (0.2270 - 0.0212) * 1e-3, rel=0.02)
    without = Calibration(launch_us=10, bandwidth_fraction=0.5, compute_fraction=0.5, all_reduce=NCCL)
    with pytest.raises(ToolkitError, match="prices no ixformer-ipc all-reduce \\(it has: nccl\\)"):
        StepCost(counted, Device(1200, {"float16": 147}, 32, 4, "ixformer-ipc"), without)


REPLAY = Path(__file__).resolve().parent.parent.parent / "shared" / "platform-replay" / "requests.csv"


def _replay_file(tmp_path: Path, rows: list[str]) -> Path:
    path = tmp_path / "requests.csv"
    path.write_text("index,request_id,prompt_tokens,output_tokens,finish_reason,completion_limit,failed_on_694\n"
                    + "\n".join(rows) + "\n", encoding="utf-8")
    return path


def test_the_replays_shapes_are_read_whole_in_order_and_a_bad_row_is_refused_with_its_line(tmp_path: Path) -> None:
    from toolkit.bench import workloads

    every = workloads.recorded(REPLAY)
    assert len(every) == 881 and [r.index for r in every] == list(range(881))
    assert sum(r.prompt_tokens is not None for r in every) == 664
    assert every[113].prompt_tokens == 254_336 and every[113].completion_limit == 4096
    with pytest.raises(ToolkitError, match=r"requests.csv:3: index 2 where 1 comes next"):
        workloads.recorded(_replay_file(tmp_path, ["0,a,10,5,stop,,", "2,b,10,5,stop,,"]))
    with pytest.raises(ToolkitError, match=r"requests.csv:2: prompt_tokens '1e4' is not a count"):
        workloads.recorded(_replay_file(tmp_path, ["0,a,1e4,5,stop,,"]))
    headless = tmp_path / "bare.csv"
    headless.write_text("index,prompt_tokens\n0,5\n", encoding="utf-8")
    with pytest.raises(ToolkitError, match=r"bare.csv:1: no column request_id, output_tokens, completion_limit"):
        workloads.recorded(headless)
    # bench cannot send shapes: it says which verb predicts them
    with pytest.raises(ToolkitError, match="cannot be sent") as error:
        workloads.replay(REPLAY)
    assert "--workload replay" in (error.value.hint or "")


def test_a_workload_file_is_never_cut_without_saying_so(tmp_path: Path) -> None:
    from toolkit.bench import workloads

    path = tmp_path / "conversations.jsonl"
    path.write_text("".join(f'{{"id": "c{i}", "turns": [{{"user": "q{i}"}}]}}\n' for i in range(12)), encoding="utf-8")
    every, said = workloads.build("conversations", None, path)
    assert len(every) == 12 and said is None
    some, said = workloads.build("conversations", 8, path)
    assert len(some) == 8 and said == f"--requests 8: the first 8 of the 12 conversations in {path}"
    assert len(workloads.build("short", None, None)[0]) == 8


def _replay_cost(step: Step) -> float:
    """A prefill token costs 1 ms, a decode step 50 ms."""
    return 0.001 * sum(c.tokens for c in step.prefills) + (0.05 if step.decodes else 0.0)


def test_the_replay_runs_one_at_a_time_inside_its_budget_and_every_request_not_served_fails(tmp_path: Path) -> None:
    from toolkit.bench import workloads
    from toolkit.estimate import replay

    rows = workloads.recorded(_replay_file(tmp_path, [
        "0,a,1000,10,stop,,", "1,b,1500,10,stop,,", "2,c,,,,,", "3,d,9000,10,stop,4096,", "4,e,2000,20,stop,,"]))
    served = replay.Served(max_model_len=10_000, prefix_caching=True, cuts_completion_limit=False)
    limits = Limits(max_num_batched_tokens=512, max_num_seqs=4)
    whole = replay.predict(rows, served, limits, _replay_cost)
    # row 2's lengths are the known ones' means (3,375 prompt, 12.5 -> 12 output); row 3 asks 9,000 + 4,096 of a
    # 10,000-token context: vLLM 0.6.3's 400, in no time
    assert [r.prompt_tokens for r in whole.records] == [1000, 1500, 3375, 9000, 2000]
    assert [r.failure for r in whole.records] == [None, None, None, "http_4xx", None]
    assert any("1 of 5 prompt lengths are not in the file: each is the known ones' mean, 3,375" in s
               for s in whole.said)
    # the deepest context the variant runs of it (what its census counts): row 3 is refused and runs nothing; with
    # its limit cut to the room left it is served, its 10 tokens after its 9,000
    assert replay.longest(rows, served) == 3375 + 12
    assert replay.longest(rows, dataclasses.replace(served, cuts_completion_limit=True)) == 9000 + 10
    # the prefix cache: the longest shorter prompt among the three before, in whole blocks
    assert [r.cached_tokens for r in whole.records] == [0, 992, 1488, 0, 1488]
    # each request is sent when the one before it ends: 1000 tokens at 1 ms, then 9 decode steps of 50 ms
    first = whole.records[0]
    assert (first.t0, first.ttft, first.e2e) == (0.0, pytest.approx(1.0), pytest.approx(1.45))
    assert whole.records[1].t0 == pytest.approx(1.45)
    assert whole.finished == 4 and whole.metrics["success_rate"] == pytest.approx(4 / 5)
    # a budget that ends inside request 1: request 1 is cut, the others never start; all of them failures
    tight = replay.predict(rows, served, limits, _replay_cost, budget_s=1.5)
    assert [(r.ok, r.failure, r.message) for r in tight.records] == [
        (True, None, ""), (False, "timeout", "still running when the budget ended"),
        (False, "timeout", "not dispatched inside the budget"), (False, "timeout", "not dispatched inside the budget"),
        (False, "timeout", "not dispatched inside the budget")]
    assert (tight.finished, tight.cut, tight.dispatched, tight.refused) == (1, 1, 2, 0)
    assert tight.metrics["success_rate"] == pytest.approx(1 / 5) and tight.wall_s == 1.5
    # the completion-limit cut serves row 3 with the room left
    cut = replay.predict(rows, replay.Served(10_000, True, True), limits, _replay_cost)
    assert cut.records[3].ok and cut.records[3].completion_tokens == 10
    assert cut.finished == 5


def test_the_replays_prefix_model_is_checked_against_the_logged_hit_rate() -> None:
    from toolkit.bench import workloads
    from toolkit.estimate import replay

    rows = workloads.recorded(REPLAY)
    prompts = [r.prompt_tokens or 0 for r in rows]
    hits = replay.cached(prompts)
    served = [i for i, r in enumerate(rows) if r.prompt_tokens is not None and r.index < 683]
    rate = sum(hits[i] for i in served) / sum(prompts[i] for i in served)
    # the threads' median length as its window, not a fit: 53% of the prompt tokens against 58% logged
    assert 0.45 < rate < replay.LOGGED_HIT_RATE


def test_a_decode_costs_more_with_its_context_on_the_path_the_target_measured(tmp_path: Path) -> None:
    """The calibration's decode against context: two lines through the figures that decide them (two on each side of
    32,768 tokens, where the adapter's decode changes path); the other figures are predictions within 25%."""
    from conftest import REPO

    _, decode, checks = calibrate.timings(REPO / "benchmarks" / "data" / "target-timings.yaml", ranks=4)
    assert decode is not None and decode.path_above == 32_768
    assert 1 / decode.seconds(32_768) == pytest.approx(10.188) and 1 / decode.seconds(235_000) == pytest.approx(3.698)
    predicted = checks["decode_context"]["predicted"]
    assert sorted(predicted) == ["131072", "65536"]
    for figure in predicted.values():
        assert abs(figure["predicted_tok_s"] / figure["measured_tok_s"] - 1) < 0.25
    # a counted decode (at the census's 65 tokens) gets what the context adds on the target; a prefill nothing
    counted = Counted([_step((65,), (), 100), _step((), (16,), 100), _step((), (256,), 400)], tmp_path, [])
    flat = Calibration(launch_us=10, bandwidth_fraction=1, compute_fraction=1)
    short, deep = (StepCost(counted, BI_V100, dataclasses.replace(flat, decode_context=context))
                   for context in (None, decode))
    assert deep(Step((65,), ())) == pytest.approx(short(Step((65,), ())))
    at_235k = deep(Step((235_000,), ())) - short(Step((235_000,), ()))
    assert at_235k == pytest.approx(1 / 3.698 - decode.seconds(65), rel=1e-6)
    assert deep(Step((), (Chunk(256, 200_000),))) == short(Step((), (Chunk(256, 200_000),)))
    # the calibration file keeps it, with what decided it and what it predicts
    fitted = calibrate.Fitted(dataclasses.replace(flat, all_reduce={"nccl": AllReduce(1, 1)}, decode_context=decode),
                              0.0, "made", checks=checks)
    written = tmp_path / "calibration.yaml"
    written.write_text(fitted.as_yaml(), encoding="utf-8")
    again = calibrate.read(written)
    assert again.calibration.decode_context == decode and again.checks["decode_context"] == checks["decode_context"]


def test_a_switch_only_the_image_library_reads_does_not_count_its_variant_again() -> None:
    """ENABLE_CUSTOM_IPC changes how the device reduces (priced by the device model), not the code the census runs:
    its variants share a census; a switch the served code reads does not."""
    from toolkit.commands.estimate import _census_key

    def config(env: dict[str, str]) -> str:
        items = "".join(f"  - name: {k}\n    value: '{v}'\n" for k, v in env.items())
        return f"command: [python, -m, vllm.entrypoints.openai.api_server, --max-num-seqs, '4']\nenv:\n{items}"

    device_only = frozenset({"ENABLE_CUSTOM_IPC"})
    ipc = _census_key(config({"ENABLE_CUSTOM_IPC": "1", "MOE_NATIVE": "1"}), device_only)
    assert ipc == _census_key(config({"ENABLE_CUSTOM_IPC": "0", "MOE_NATIVE": "1"}), device_only)
    assert ipc != _census_key(config({"ENABLE_CUSTOM_IPC": "1", "MOE_NATIVE": "0"}), device_only)
    assert ipc != _census_key(config({"ENABLE_CUSTOM_IPC": "0", "MOE_NATIVE": "1"}), frozenset())
