"""estimate: what the platform would measure of each variant, predicted from what its served path runs at the
target's shapes (toolkit/estimate/)."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.commands.common import Inputs, chosen_variants, pinned, run_folder
from toolkit.commands.rehearse import served_tp
from toolkit.errors import EXIT_OK, ToolkitError
from toolkit.recipe import Estimate, LoadedRecipe, Recipe, load_recipe
from toolkit.results import Report
from toolkit.trial import require_complete

WORKLOADS = ("short", "tools", "conversations")


@dataclass(frozen=True)
class EstimateRequest:
    recipe: Path
    inputs: Inputs = field(default_factory=Inputs)
    variant: str | None = None
    all_variants: bool = False
    workload: str = "short"
    conversations: Path | None = None  # the conversations workload's file
    concurrency: tuple[int, ...] = (1,)
    requests: int = 8  # requests (short, tools) or conversations
    max_tokens: int = 128
    model_config: Path | None = None  # the checkpoint's config.json folder: the layers at its widths
    calibration: Path | None = None  # default: the recipe's estimate.calibration
    output: Path | None = None  # the censuses' logs and records (default: a new temporary folder, kept)
    rootfs: Path | None = None  # vendor roots as the image holds them (default: the CoreX-like reference)
    calibrate: Path | None = None  # TOOLKIT_PROFILE_SYNC=1 records from the target: fit the constants on them
    write: Path | None = None  # with calibrate: the calibration file to write (a new path)
    tp: int | None = None  # the census's ranks (default: the recipe's own tensor-parallel size)


def _tp(loaded: LoadedRecipe, request: EstimateRequest) -> int:
    if request.tp is not None and request.tp < 1:
        raise ToolkitError(f"--tp {request.tp}: a tensor-parallel size is 1 or more")
    return request.tp or served_tp(loaded) or 1


def _settings(loaded: LoadedRecipe) -> Estimate:
    if loaded.recipe.estimate is None:
        raise ToolkitError(f"{loaded.path}: no estimate: section (its layer region and calibration file)",
                           hint="include the layer that sets estimate.layer_region (layers/qwen36-adapter.yaml) and "
                           "name a calibration file under estimate.calibration (docs/estimate.md)")
    return loaded.recipe.estimate


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _census_key(run_config: str) -> str:
    """What decides the code path a census counts: the run config's env and argv, less the scheduler's budget
    (--max-num-seqs, --max-num-batched-tokens), which the simulation takes and the census replaces."""
    import yaml

    from toolkit.bench import experiment

    config = yaml.safe_load(run_config)
    given = [str(a) for a in config.get("command") or []]
    # `--flag true` is vLLM's boolean switch given as `--flag` (its StoreBoolean action)
    argv = [a for i, a in enumerate(given) if not (a.lower() == "true" and i and given[i - 1].startswith("--"))]
    for flag in ("--max-num-seqs", "--max-num-batched-tokens"):
        argv = experiment.set_flag(argv, flag, "-")
    return hashlib.sha256(json.dumps([argv, config.get("env")], sort_keys=True).encode()).hexdigest()[:16]


def count_variants(loaded: LoadedRecipe, found: dict[str, Path], recipes: dict[str, tuple[Recipe, str]],
                   request: EstimateRequest, rundir: Path) -> dict[str, Any]:
    """Each variant's census (`toolkit.estimate.count`), one per distinct code path, on one patched tree."""
    from toolkit.bench.experiment import run_config_env
    from toolkit.bench.serve import stray_processes
    from toolkit.estimate.count import Plan, count
    from toolkit.rehearsal import Rehearsal
    from toolkit.rehearsal.servers import Stage, server_environment
    from toolkit.runtime import preflight as runtime_preflight
    from toolkit.runtime import tiny_model
    from toolkit.runtime.env import runtime

    model = loaded.recipe.model
    settings = _settings(loaded)
    if model is None and request.model_config is None:
        raise ToolkitError("estimate needs the served model's shape", hint="add a `model:` section to the recipe, "
                           "or pass --model-config DIR")
    tp = _tp(loaded, request)
    strays = stray_processes()
    if strays:
        # its ranks would share this machine's cores and memory, and the native MoE's `auto` choice is timed
        raise ToolkitError("refusing to count beside a running server: " + "; ".join(strays),
                           hint="stop it first: its workers would share this machine's cores and memory")
    python = runtime()
    wide = rundir / "wide-model"
    wide.mkdir(parents=True, exist_ok=True)
    config, layers = tiny_model.wide_config(model, request.model_config)
    census_layers = int(config.get("text_config", config)["num_hidden_layers"])
    (wide / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    counted: dict[str, Any] = {}
    by_key: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="toolkit-estimate-tree-") as tmp:
        work = Path(tmp)
        image = work / "image"
        if request.rootfs is not None:
            tree = runtime_preflight.patched_copy(loaded, found, work, request.rootfs,
                                                  dict(request.inputs.package_roots), image=image)
        else:
            tree = runtime_preflight.patched_copy(loaded, found, work, image=image)
        for name, (variant_recipe, run_config) in recipes.items():
            key = _census_key(run_config)
            if key in by_key:
                counted[name] = by_key[key]
                _say(f"estimate: {name} runs the code path already counted")
                continue
            folder = rundir / name
            stage = Stage(variant_recipe, run_config, tree, python, wide, tp, folder, image,
                          variant_recipe.hardware.memory_gb, _say, Rehearsal(name, tp, folder))
            env = run_config_env(run_config)
            resolved = {k: v for k, v in settings.timed_switches.items() if env.get(k, "auto") == "auto"}
            full_env, _ = server_environment(stage, {**env, **resolved}, folder / "standins" / "standins.json", {},
                                             "census")
            (folder / "standins").mkdir(parents=True, exist_ok=True)
            by_key[key] = counted[name] = count(run_config, full_env, python, wide, tp, folder, layers, census_layers,
                                                settings.layer_region, Plan(), _say)
            counted[name].changed += [f"env {k} {env.get(k, '(not given)')} -> {v} (estimate.timed_switches: the "
                                      "target's choice, not this CPU's timing)" for k, v in resolved.items()]
    return counted


def _limits(loaded: LoadedRecipe, recipe: Recipe, name: str) -> Any:
    """The scheduler's budget as the variant serves (lint's reading of its args: vLLM 0.6.3's defaults where they
    are not given, chunked prefill on by itself above 32K)."""
    from toolkit.estimate.schedule import Limits
    from toolkit.lint.context import LintContext

    context = LintContext(loaded, recipe, name)
    chunked = context.chunked_prefill_effective()
    return Limits(context.max_num_batched_tokens() or 512, context.int_arg("max-num-seqs", 256) or 256, chunked)


def _variant_recipes(loaded: LoadedRecipe, request: EstimateRequest, dropped: list[str] | None = None,
                     not_accepted: list[str] | None = None) -> dict[str, tuple[Recipe, str]]:
    """The chosen variants that can start (lint finds no error: `toolkit variants` drops the others, and vLLM
    refuses them), each with its run config; the dropped ones' names and first error in `dropped`; what only the
    platform's submission requires (estimated all the same) in `not_accepted`."""
    from toolkit.lint import lint as lint_recipe
    from toolkit.submission.render import render

    out = {}
    for variant in chosen_variants(loaded, request.variant, request.all_variants):
        recipe = variant.apply(loaded.recipe)
        result = lint_recipe(loaded, recipe, variant=variant.name, for_submission=False)
        errors = result.refusals
        if not_accepted is not None:
            not_accepted += [f"{variant.name}: {i.rule}: {i.message}" for i in result.not_a_submission]
        if errors:
            if dropped is None:
                raise ToolkitError(f"variant {variant.name} cannot start: {errors[0].rule}: {errors[0].message}",
                                   hint="`toolkit lint RECIPE --variant NAME` says why")
            dropped.append(f"{variant.name} ({errors[0].rule})")
            continue
        out[variant.name] = (recipe, render(recipe, loaded.path.name, variant.name).run_config)
    if not out:
        raise ToolkitError("no chosen variant can start: lint finds an error in each",
                           hint="`toolkit variants RECIPE` lists them")
    return out


def _rundir(request: EstimateRequest) -> Path:
    return run_folder(request.output, "toolkit-estimate-", "the estimate")


def _fmt(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def estimate(request: EstimateRequest) -> Report:
    """Each chosen variant's predicted decode step, prefill and workload metrics (exit 0), or the calibration fitted
    on the target's records with --calibrate."""
    from toolkit.bench import workloads
    from toolkit.estimate import calibrate, predict
    from toolkit.estimate.device import device_of

    if request.workload not in WORKLOADS:
        raise ToolkitError(f"--workload {request.workload}: not one of {', '.join(WORKLOADS)}")
    if any(c < 1 for c in request.concurrency):
        raise ToolkitError(f"--concurrency {request.concurrency}: each concurrency is 1 or more")
    loaded, found = pinned(load_recipe(request.recipe), request.inputs)
    require_complete(loaded, found, "estimate")  # its census serves the variant's argv on the patched tree
    recipe = loaded.recipe
    settings = _settings(loaded)
    if request.calibrate is not None:
        return _calibrate(loaded, found, request)
    if request.write is not None:
        raise ToolkitError(f"--write {request.write} without --calibrate: nothing to write",
                           hint="--calibrate DIR --write FILE fits the constants and writes them")
    calibration_file = request.calibration or calibrate.calibration_path(loaded.path, settings.calibration)
    fitted = calibrate.read(calibration_file)
    if request.requests < 1 or request.max_tokens < 1:
        raise ToolkitError(f"--requests {request.requests} --max-tokens {request.max_tokens}: each is 1 or more")
    conversations = workloads.build(request.workload, request.requests, request.conversations)
    max_tokens = request.max_tokens
    dropped: list[str] = []
    not_accepted: list[str] = []
    recipes = _variant_recipes(loaded, request, dropped, not_accepted)
    rundir = _rundir(request)
    started = time.monotonic()
    counted = count_variants(loaded, found, recipes, request, rundir)
    device = device_of(recipe.hardware, _tp(loaded, request))
    rows: list[tuple[str, ...]] = []
    data: dict[str, Any] = {}
    factor = fitted.spread
    for name, (variant_recipe, _) in recipes.items():
        census = counted[name]
        cost = predict.StepCost(census, device, fitted.calibration)
        own = predict.regions(cost.ops[("decode", int(cost.decode_points[0][0]))], device, fitted.calibration)
        top = sorted({r for r in own if r.count(".") <= 3}, key=lambda r: -predict.inclusive(own, r))
        breakdown = {r: round(predict.inclusive(own, r) * 1e3, 3) for r in top}
        table = {r: {"ms": round(v["seconds"] * 1e3, 4), "launches": v["launches"], "flops": v["flops"],
                     "bytes": v["bytes"]} for r, v in sorted(own.items())}
        runs = []
        for concurrency in request.concurrency:
            clients = predict.requests(conversations, concurrency, max_tokens)
            result = predict.predict(cost, _limits(loaded, variant_recipe, name), clients)
            runs.append(result.as_json(factor))
            m = result.metrics
            rows.append((name, str(concurrency), _fmt(m["ttft_p90_ms"] and m["ttft_p90_ms"] / 1e3),
                         _fmt(m["output_tps_e2e_p10"]), _fmt(m["output_tps_e2e_p50"]), _fmt(m["output_tps_agg"]),
                         _fmt(m["official_replay_score"], 0),
                         f"{_fmt(m['output_tps_agg'] / factor)}..{_fmt(m['output_tps_agg'] * factor)}"))
        data[name] = {
            "range_factor": factor,
            "decode_step_ms": {str(int(b)): round(s * 1e3, 3) for b, s in cost.decode_points},
            "prefill_step_ms": {str(int(t)): round(s * 1e3, 3) for t, s in cost.prefill_points},
            "decode_breakdown_ms": breakdown, "decode_regions": table, "runs": runs, "census": str(census.folder),
            "census_changes": census.changed, "notes": census.notes}
    notes = [f"calibration {calibration_file} (fitted on {fitted.fitted_on}); predictions range over a factor "
             f"{factor:.2f} either way (the fit's largest miss)",
             f"workload {request.workload}: {len(conversations)} request(s), max_tokens {max_tokens}, prompt lengths "
             f"from their text at {predict.CHARS_PER_TOKEN:g} characters a token",
             f"counted at the target's widths in {time.monotonic() - started:.0f} s; censuses in {rundir}"]
    if dropped:
        notes.append(f"{len(dropped)} variant(s) left out, as `toolkit variants` drops them (vLLM would refuse to "
                     "start them): " + ", ".join(dropped))
    notes += [f"estimated, but not a submission: {said}" for said in not_accepted]
    for name, entry in data.items():
        steps = ", ".join(f"{b} seq {ms:.1f} ms" for b, ms in entry["decode_step_ms"].items())
        chunks = ", ".join(f"{t} tok {ms:.0f} ms" for t, ms in entry["prefill_step_ms"].items())
        notes.append(f"{name}: decode step {steps}; prefill {chunks}")
        shown = list(entry["decode_breakdown_ms"].items())[:8]
        parts = ", ".join(f"{r.removeprefix('step.')} {ms:.1f}" for r, ms in shown)
        notes.append(f"{name}: decode step (1 seq) by region, ms: {parts}")
    for name, census in counted.items():
        if census.changed and name == next(iter(counted)):
            notes.append("the census serves the run config's argv with: " + "; ".join(census.changed)
                         + "; the model at its widths with one full-attention interval of layers, dummy weights")
    notes += _ranking(data, request.concurrency, factor)
    report = Report("estimate", str(loaded.path), notes=tuple(notes),
                    columns=("variant", "c", "TTFT P90 s", "TPS P10", "TPS P50", "agg TPS", "score",
                             "agg TPS range"),
                    rows=tuple(rows), extra={"variants": data, "calibration": calibrate.to_json(fitted),
                                               "not_a_submission": not_accepted})
    return dataclasses.replace(report, exit_code=EXIT_OK)


def fit_on(counted: Any, device: Any, records: Path) -> Any:
    """The calibration fitted on `records` with a variant's census (its decode step of one sequence)."""
    from toolkit.estimate import calibrate

    decode = [s for s in counted.steps if s.decodes and not s.prefills]
    if not decode:
        raise ToolkitError(f"the census in {counted.folder} counted no decode step to fit on")
    one = [s for s in decode if len(s.decodes) == 1] or decode
    # rank 0's fewest launches: a path's first call may do one-off work (as StepCost prices)
    steady = min(one, key=lambda s: sum(op.calls for op in s.ranks[min(s.ranks)]))
    return calibrate.fit(steady, counted.entries.get(calibrate.BUCKET, {}), device, calibrate.measured(records),
                         str(records))


def _calibrate(loaded: LoadedRecipe, found: dict[str, Path], request: EstimateRequest) -> Report:
    from toolkit.estimate import calibrate
    from toolkit.estimate.device import device_of

    records = request.calibrate
    assert records is not None
    if request.write is not None and request.write.exists():
        raise ToolkitError(f"--write {request.write} exists; nothing was fitted (a calibration never replaces a file)",
                           hint="give a new path, then name it under estimate.calibration")
    if request.all_variants:
        raise ToolkitError("--calibrate fits on one variant's census: the configuration the records were taken "
                           "with", hint="--variant NAME (default: the base)")
    calibrate.measured(records)  # refused before a census runs
    recipes = _variant_recipes(loaded, request)
    rundir = _rundir(request)
    counted = count_variants(loaded, found, recipes, request, rundir)
    [name] = recipes
    fitted = fit_on(counted[name], device_of(loaded.recipe.hardware, _tp(loaded, request)), records)
    rows = tuple((region, _fmt(v["measured_ms"], 3), _fmt(v["fitted_ms"], 3),
                  _fmt(v["fitted_ms"] / v["measured_ms"] if v["measured_ms"] else None, 2))
                 for region, v in fitted.regions.items())
    c = fitted.calibration
    notes = [f"fitted on {records} with the {name} variant's census ({rundir}): launch {c.launch_us:.1f} "
             f"us, bandwidth fraction {c.bandwidth_fraction:.2f}, all-reduce {c.all_reduce_us:.1f} us, profiler "
             f"synchronise {fitted.sync_us:.1f} us (left out of predictions), compute fraction "
             f"{c.compute_fraction:.2f} (a prior); largest miss a factor {fitted.spread:.2f}"]
    if request.write is not None:
        request.write.parent.mkdir(parents=True, exist_ok=True)
        partial = request.write.with_name(request.write.name + ".partial")
        partial.write_text(fitted.as_yaml(), encoding="utf-8")
        partial.replace(request.write)
        notes.append(f"wrote {request.write}: name it under estimate.calibration (relative to the recipe)")
    else:
        notes.append("not written (--write FILE writes it)")
    return Report("estimate", str(loaded.path), notes=tuple(notes),
                  columns=("region", "measured ms/call", "fitted ms/call", "fitted / measured"), rows=rows,
                  extra={"calibration": calibrate.to_json(fitted), "census": str(rundir)})


def _ranking(data: dict[str, Any], concurrency: tuple[int, ...], factor: float) -> list[str]:
    """The variants by predicted score at each concurrency; neighbours closer than the calibration's range are said
    to be indistinguishable."""
    if len(data) < 2:
        return []
    out = []
    for index, c in enumerate(concurrency):
        ranked = sorted(data, key=lambda n: -(data[n]["runs"][index]["official_replay_score"] or 0))
        parts = [ranked[0]]
        for before, after in itertools.pairwise(ranked):
            a = data[before]["runs"][index]["official_replay_score"] or 0
            b = data[after]["runs"][index]["official_replay_score"] or 0
            parts.append((" ~ " if b and a / b < factor else " > ") + after)
        out.append(f"ranking at c={c} by predicted score: {''.join(parts)} (~: within the calibration's range, the "
                   "estimate cannot tell them apart)")
    return out

