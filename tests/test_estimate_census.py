"""toolkit estimate end to end: the census runs the variant's own engine on the patched tree in the CPU runtime (a
narrow model of the flagship's architecture at TP 2, to keep the suite's time), and what it counts changes with the
code path a variant switches; --calibrate fits on the records such a run writes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import FLAGSHIP, REPO

from toolkit.commands.common import Inputs
from toolkit.commands.estimate import EstimateRequest, estimate
from toolkit.errors import ToolkitError
from toolkit.recipe import load_recipe
from toolkit.runtime import tiny_model

NATIVE = "step.model_forward.layer.moe.routed.native_"


def _narrow_config(folder: Path) -> Path:
    """The flagship's model with every width cut (the layer pattern, head ratios and expert routing kept)."""
    model = load_recipe(FLAGSHIP).recipe.model
    assert model is not None and model.moe is not None and model.linear_attention is not None
    narrow = model.model_copy(update={
        "hidden_size": 256, "head_dim": 64, "num_attention_heads": 8, "vocab_size": 1024,
        "moe": model.moe.model_copy(update={"num_experts": 16, "experts_per_token": 4, "intermediate_size": 64,
                                            "shared_intermediate_size": 64}),
        "linear_attention": model.linear_attention.model_copy(update={"key_head_dim": 32, "value_head_dim": 64})})
    config, _ = tiny_model.wide_config(narrow)  # one interval of layers: the checkpoint's config has all 40
    text = config["text_config"]
    text["num_hidden_layers"] = model.num_layers
    text["layer_types"] = text["layer_types"] * (model.num_layers // len(text["layer_types"]))
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def _recipe(folder: Path) -> Path:
    """A copy of the flagship (its layers and calibration beside it) whose base serves the native MoE (the MoE
    kernels off: one owner), with one variant that turns the native MoE off and nothing else (the adapter's own MoE),
    and none of its grid."""
    for name in ("recipes", "layers"):
        shutil.copytree(REPO / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    recipe = folder / "recipes" / FLAGSHIP.name
    head, _, _ = recipe.read_text(encoding="utf-8").partition("\nvariants:")
    # checks.fast_paths_off names a variant this copy drops
    head = "\n".join(line for line in head.splitlines() if not line.strip().startswith("fast_paths_off:"))
    for switch, value in (("MOE_NATIVE", "1"), ("BI100_MOE_COREX_DIRECT_ROUTED", "0"),
                          ("BI100_MOE_COREX_EXACT_REDUCE", "0"), ("BI100_MOE_COREX_WEIGHT_GATHER", "0")):
        head, count = re.subn(rf"(?m)^  {switch}: \"[01]\"$", f'  {switch}: "{value}"', head)
        assert count == 1, switch
    recipe.write_text(head + "\nvariants:\n  moe-adapter:\n    env:\n      MOE_NATIVE: \"0\"\n", encoding="utf-8")
    return recipe


@pytest.fixture(scope="module")
def switched(tmp_path_factory: pytest.TempPathFactory, adapter_args: list[str]) -> tuple[Any, Path, Inputs, Path]:
    work = tmp_path_factory.mktemp("estimate")
    name, _, where = adapter_args[1].partition("=")
    inputs = Inputs(sources={name: where})
    recipe, config = _recipe(work), _narrow_config(work / "config")
    report = estimate(EstimateRequest(recipe, inputs, all_variants=True, concurrency=(1, 2), requests=4,
                                      max_tokens=16, model_config=config, tp=2, output=work / "run"))
    return report, recipe, inputs, config


def test_the_native_moe_switch_changes_the_count_and_the_prediction(switched: tuple[Any, Path, Inputs, Path]
                                                                    ) -> None:
    report, *_ = switched
    assert report.exit_code == 0, report.as_json()
    variants = report.extra["variants"]
    native, adapter = variants["base"], variants["moe-adapter"]
    assert any(region.startswith(NATIVE) for region in native["decode_regions"])
    assert not any(region.startswith(NATIVE) for region in adapter["decode_regions"])
    routed = "step.model_forward.layer.moe.routed"
    assert native["decode_regions"][routed] != adapter["decode_regions"][routed]
    assert native["decode_step_ms"] != adapter["decode_step_ms"]
    assert [r["output_tps_agg"] for r in native["runs"]] != [r["output_tps_agg"] for r in adapter["runs"]]
    for variant in (native, adapter):
        # the layers' operations are scaled from the counted interval (4 layers) to the flagship's 40
        assert variant["decode_regions"]["step.model_forward.layer.moe.all_reduce"]["launches"] == pytest.approx(40)
        assert [run["requests"] for run in variant["runs"]] == [4, 4]
        assert all(run["ttft_p90_ms"] > 0 and run["output_tps_agg"] > 0 for run in variant["runs"])
    assert any("ranking at c=2 by predicted score" in note for note in report.notes)
    assert _census_processes() == [], "no rank of a census outlives it"


def _census_processes() -> list[int]:
    """Processes started with the census switch in their environment (a census's driver or ranks)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"TOOLKIT_CENSUS=" in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


GATHER = "vllm.corex_paged_kv_gather.gather"  # the adapter's KV gather kernel, one launch in the census


def test_the_census_counts_the_replays_contexts_the_gather_kernel_only_above_32768(
        switched: tuple[Any, Path, Inputs, Path], tmp_path: Path) -> None:
    """A replay whose longest request passes 32,768 tokens is counted at contexts up to it: the adapter's decode
    takes its PyTorch path with the KV gather kernel above 32,768 tokens of context and its paged kernel at or below
    (every rank, every step), and a prefill chunk deep in a prompt costs more than a cold one (its prefix
    attention), the more the deeper."""
    from toolkit.estimate.count import read

    _, recipe, inputs, config = switched
    shapes = tmp_path / "requests.csv"
    shapes.write_text("index,request_id,prompt_tokens,output_tokens,finish_reason,completion_limit,failed_on_694\n"
                      "0,a,33000,100,stop,,\n1,b,2000,50,stop,,\n", encoding="utf-8")
    report = estimate(EstimateRequest(recipe, inputs, variant="base", workload="replay", conversations=shapes,
                                      model_config=config, tp=2, output=tmp_path / "run"))
    assert report.exit_code == 0, report.as_json()
    base = report.extra["variants"]["base"]
    counted = read(Path(base["census"]), 2, 40, 4, "step.model_forward.layer")
    decodes = [step for step in counted.steps if step.decodes and not step.prefills]
    above = [step for step in decodes if max(step.decodes) > 32768]
    assert above and min(max(s.decodes) for s in above) < 34000 and max(max(s.decodes) for s in above) >= 33000
    for step in decodes:
        for rank, ops in step.ranks.items():
            calls = sum(op.calls for op in ops if op.name == GATHER)
            # one call a sequence in each full-attention layer, scaled from the counted one to the model's 10
            assert calls == (10 if step in above else 0), (step.decodes, rank)
    context = {int(c): ms for c, ms in base["context_decode_ms"].items()}
    below = max(c for c in context if c <= 32768)
    assert context[min(c for c in context if c > 32768)] > context[below]
    depth = {int(d): ms for d, ms in base["depth_ms_per_token"].items()}
    assert 0 < depth[4096] < depth[16384] < depth[32768]
    assert any("counted contexts: one sequence's decode step" in note for note in report.notes)


def test_calibrate_fits_on_a_runs_records_and_never_replaces_a_file(switched: tuple[Any, Path, Inputs, Path],
                                                                     tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    report, recipe, inputs, config = switched
    records = Path(report.extra["variants"]["moe-adapter"]["census"]) / "profile"
    written = tmp_path / "fitted.yaml"
    # the target's timings as if taken at the census's TP 2 (a ring's traffic depends on the ranks)
    timings = tmp_path / "timings.yaml"
    timings.write_text((REPO / "benchmarks" / "data" / "target-timings.yaml").read_text(encoding="utf-8").replace(
        "ranks: 4", "ranks: 2"), encoding="utf-8")
    fitted = estimate(EstimateRequest(recipe, inputs, variant="moe-adapter", tp=2, calibrate=records,
                                      model_config=config, write=written, output=tmp_path / "run", timings=timings))
    calibration = fitted.extra["calibration"]
    assert calibration["fitted_with"]["variant"] == "moe-adapter"
    assert calibration["fitted_with"]["all_reduce"] == "ixformer-ipc"  # the flagship's ENABLE_CUSTOM_IPC=1
    assert calibration["decode_context"]["path_above"] == 32_768
    assert written.is_file() and written.read_text(encoding="utf-8").startswith("# toolkit estimate's")
    assert all(max(r["fitted_ms"] / r["measured_ms"], r["measured_ms"] / r["fitted_ms"]) <= calibration["spread"]
               for r in calibration["regions"].values())
    assert {"step.model_forward.layer.moe", "step.model_forward.layer.gdn"} <= set(calibration["regions"])
    # the written file is what the next estimate reads, here of a replay's shapes: every request counted, the one
    # whose prompt fills the context refused (it runs nothing, so no census counts its context), the one with no
    # output length filled and said
    shapes = tmp_path / "requests.csv"
    shapes.write_text("index,request_id,prompt_tokens,output_tokens,finish_reason,completion_limit,failed_on_694\n"
                      "0,a,300,6,stop,,\n1,b,500,4,tool_calls,,\n2,c,400,,,,\n3,d,270000,4,stop,4096,\n",
                      encoding="utf-8")
    capsys.readouterr()
    again = estimate(EstimateRequest(recipe, inputs, all_variants=True, tp=2, calibration=written,
                                     workload="replay", conversations=shapes, model_config=config,
                                     output=tmp_path / "again"))
    # the same code paths on the same tree: both censuses are the fixture's, read back from the cache
    assert capsys.readouterr().err.count("the census of this code path is cached") == 2
    assert any(note.startswith("ranking at c=1 by predicted score") for note in again.notes)
    assert again.extra["calibration"]["launch_us"] == pytest.approx(calibration["launch_us"])
    replayed = again.extra["variants"]["moe-adapter"]["replay"]
    assert (replayed["requests"], replayed["finished"], replayed["refused"]) == (4, 3, 1)
    assert replayed["success_rate"] == pytest.approx(3 / 4)
    assert any("1 of 4 output lengths are not in the file" in said for said in replayed["said"])
    [row] = [row for row in again.rows if row[0] == "moe-adapter"]
    assert "finished in budget" in again.columns and row[7] == "3/4 in " + f"{replayed['wall_s']:,.0f} s"
    with pytest.raises(ToolkitError, match="the platform replays one request at a time"):
        estimate(EstimateRequest(recipe, inputs, workload="replay", conversations=shapes, concurrency=(1, 2)))
    with pytest.raises(ToolkitError, match="exists; nothing was fitted"):
        estimate(EstimateRequest(recipe, inputs, calibrate=records, write=written))
    unsynced = tmp_path / "unsynced"
    unsynced.mkdir()
    for source in records.glob("profile-*.jsonl"):
        lines = [json.loads(line) for line in source.read_text(encoding="utf-8").splitlines()]
        (unsynced / source.name).write_text("".join(json.dumps({**line, "sync": False}) + "\n" for line in lines),
                                            encoding="utf-8")
    with pytest.raises(ToolkitError, match="without TOOLKIT_PROFILE_SYNC=1"):
        estimate(EstimateRequest(recipe, inputs, calibrate=unsynced, timings=timings))
    with pytest.raises(ToolkitError, match="--calibrate needs the target's timings"):
        estimate(EstimateRequest(recipe, inputs, calibrate=records))
    with pytest.raises(ToolkitError, match="without --calibrate: nothing to write"):
        estimate(EstimateRequest(recipe, inputs, write=tmp_path / "new.yaml"))


def test_what_the_estimate_cannot_run_is_refused_before_a_census(tmp_path: Path, adapter: tuple[Path, str]) -> None:
    clone, commit = adapter
    sources = Inputs({"qwen36-adapter": f"{clone}@{commit}"})  # (without: tests/test_complete_tree.py)
    with pytest.raises(ToolkitError, match="--workload bodies: not one of"):
        estimate(EstimateRequest(FLAGSHIP, workload="bodies"))
    with pytest.raises(ToolkitError, match="--workload replay needs the replay's shapes file"):
        estimate(EstimateRequest(FLAGSHIP, sources, workload="replay"))
    with pytest.raises(ToolkitError, match="--requests with --workload replay: the platform replays every request"):
        estimate(EstimateRequest(FLAGSHIP, sources, workload="replay", conversations=tmp_path / "r.csv", requests=8))
    with pytest.raises(ToolkitError, match="each concurrency is 1 or more"):
        estimate(EstimateRequest(FLAGSHIP, concurrency=(0,)))
    with pytest.raises(ToolkitError, match="no estimate: section"):
        estimate(EstimateRequest(FLAGSHIP.parent / "bi100-qwen25.yaml"))
    missing = tmp_path / "none.yaml"
    with pytest.raises(ToolkitError, match=r"calibration file .*none\.yaml does not exist"):
        estimate(EstimateRequest(FLAGSHIP, sources, calibration=missing))
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    with pytest.raises(ToolkitError, match="exists and is not an empty folder; the estimate writes only into"):
        estimate(EstimateRequest(FLAGSHIP, sources, output=kept))
    assert [p.name for p in kept.iterdir()] == ["notes.txt"]


def _census_running(recipe: Path, config: Path, adapter_args: list[str], out: Path,
                    **popen: Any) -> subprocess.Popen[str]:
    """`toolkit estimate` at TP 2 started as a user would, returned once its census has counted a first shape."""
    process = subprocess.Popen([sys.executable, "-m", "toolkit", "estimate", str(recipe), *adapter_args,
                                "--model-config", str(config), "--tp", "2", "-o", str(out), "--recount"], text=True,
                               **popen)
    log = out / "base" / "census.log"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and "[census]" not in (log.read_text() if log.is_file() else ""):
        time.sleep(0.5)
    return process


def _stop_all(process: subprocess.Popen[str]) -> None:
    process.kill()
    for pid in _census_processes():  # what a failed check would leave
        os.kill(pid, signal.SIGKILL)


def test_a_census_stopped_by_sigterm_leaves_no_rank_running(switched: tuple[Any, Path, Inputs, Path],
                                                             tmp_path: Path, adapter_args: list[str]) -> None:
    """Its ranks busy-wait on their driver: a census interrupted part-way must take all of them down."""
    _, recipe, _, config = switched
    process = _census_running(recipe, config, adapter_args, tmp_path / "run", stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        assert _census_processes(), "the census was running"
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 128 + signal.SIGTERM
        time.sleep(1)
        assert _census_processes() == []
    finally:
        _stop_all(process)


def test_a_census_whose_rank_dies_ends_at_once_with_that_ranks_error(switched: tuple[Any, Path, Inputs, Path],
                                                                      tmp_path: Path, adapter_args: list[str]) -> None:
    """Rank 0 waits on a dead rank in a gloo collective for 30 minutes: the census must not."""
    _, recipe, _, config = switched
    out = tmp_path / "run"
    process = _census_running(recipe, config, adapter_args, out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        from toolkit.runtime import census

        ranks = {line["rank"]: int(line["pid"]) for line in census.read(out / "base" / "census")}
        assert set(ranks) == {0, 1}, ranks
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        said, _ = process.communicate(timeout=60)
        assert time.monotonic() - killed < 30, "ended within seconds, not at gloo's timeout"
        assert process.returncode == 2, said  # a variant that cannot run, as any census that fails
        assert "the census of the served path stopped" in said
        assert f"pid {ranks[1]} died, exit code: -9" in said, said
        assert f"pid {ranks[1]} rank 1" in said
        time.sleep(1)
        assert _census_processes() == [], "no rank of a failed census outlives it"
    finally:
        _stop_all(process)


# a rank that raises in its step loop stays alive (vLLM's worker process catches the exception and waits for its
# next task) while rank 0 waits for it in the next collective: gloo's timeout is 30 minutes
RAISING = """
transforms:
  - id: test-rank-1-raises
    kind: statements
    file: vllm/worker/worker_base.py
    scope: LocalOrDistributedWorkerBase.execute_model
    after: model_input, worker_input, kwargs = inputs
    new: |
      if not self.is_driver_worker:
          type(self).test_steps = getattr(type(self), "test_steps", 0) + 1
          if type(self).test_steps == 8:
              raise RuntimeError("a rank's failure, injected by tests/test_estimate_census.py")
    why: the other ranks' failure mode that ends no process
    remove_when: never (a test's mutant)
"""


def test_a_census_whose_rank_raises_ends_at_once_with_that_ranks_error(switched: tuple[Any, Path, Inputs, Path],
                                                                        tmp_path: Path) -> None:
    _, _, inputs, config = switched
    recipe = _recipe(tmp_path / "raising")
    recipe.write_text(recipe.read_text(encoding="utf-8") + RAISING, encoding="utf-8")
    started = time.monotonic()
    with pytest.raises(ToolkitError) as raised:
        estimate(EstimateRequest(recipe, inputs, variant="base", tp=2, requests=2, max_tokens=4, model_config=config,
                                 output=tmp_path / "run"))
    assert time.monotonic() - started < 300, "ended within seconds of the failure, not at gloo's timeout"
    said = raised.value.message
    assert said.startswith("the census of the served path stopped: rank 1 (pid "), said[:600]
    assert "logged: Exception in worker VllmWorkerProcess while processing method start_worker_execution_loop: " \
        "a rank's failure, injected by tests/test_estimate_census.py" in said, said[:600]
    assert _census_processes() == [], "no rank of a failed census outlives it"
