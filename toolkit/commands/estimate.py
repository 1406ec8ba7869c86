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

WORKLOADS = ("short", "tools", "conversations", "replay")


@dataclass(frozen=True)
class EstimateRequest:
    recipe: Path
    inputs: Inputs = field(default_factory=Inputs)
    variant: str | None = None
    all_variants: bool = False
    workload: str = "short"
    conversations: Path | None = None  # the conversations workload's file, or the replay's shapes (requests.csv)
    concurrency: tuple[int, ...] = (1,)
    requests: int | None = None  # requests (short, tools: 8 without it) or a file's first conversations (all)
    max_tokens: int = 128
    model_config: Path | None = None  # the checkpoint's config.json folder: the layers at its widths
    calibration: Path | None = None  # default: the recipe's estimate.calibration
    output: Path | None = None  # the censuses' logs and records (default: a new temporary folder, kept)
    rootfs: Path | None = None  # vendor roots as the image holds them (default: the CoreX-like reference)
    calibrate: Path | None = None  # TOOLKIT_PROFILE_SYNC=1 records from the target: fit the constants on them
    write: Path | None = None  # with calibrate: the calibration file to write (a new path)
    timings: Path | None = None  # with calibrate: the target's all-reduce calls and decode against context
    tp: int | None = None  # the census's ranks (default: the recipe's own tensor-parallel size)
    recount: bool = False  # count every code path again, neither reading nor writing the census cache


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


def _census_key(run_config: str, device_only: frozenset[str]) -> str:
    """What decides the code path a census counts: the run config's env and argv, less the scheduler's budget
    (--max-num-seqs, --max-num-batched-tokens), which the simulation takes and the census replaces, and less the env
    only a GPU library reads on the image (`device_only`: its stand-in here does not, e.g. ENABLE_CUSTOM_IPC, which
    the device model prices instead)."""
    import yaml

    from toolkit.bench import experiment

    config = yaml.safe_load(run_config)
    env = {k: v for k, v in experiment.run_config_env(run_config).items() if k not in device_only}
    given = [str(a) for a in config.get("command") or []]
    # `--flag true` is vLLM's boolean switch given as `--flag` (its StoreBoolean action)
    argv = [a for i, a in enumerate(given) if not (a.lower() == "true" and i and given[i - 1].startswith("--"))]
    for flag in ("--max-num-seqs", "--max-num-batched-tokens"):
        argv = experiment.set_flag(argv, flag, "-")
    return hashlib.sha256(json.dumps([argv, env], sort_keys=True).encode()).hexdigest()[:16]


def count_variants(loaded: LoadedRecipe, found: dict[str, Path], recipes: dict[str, tuple[Recipe, str]],
                   request: EstimateRequest, rundir: Path, longest: dict[str, int]) -> dict[str, Any]:
    """Each variant's census (`toolkit.estimate.count`), one per distinct code path, on one patched tree, counted at
    contexts up to the `longest` sequence the workload has it serve (by variant; none given: no context)."""
    from toolkit.bench import experiment as experiment_module
    from toolkit.bench.experiment import run_config_env
    from toolkit.bench.serve import stray_processes
    from toolkit.estimate import count as count_module
    from toolkit.estimate.count import Plan, contexts_for, count, count_cached
    from toolkit.pyenv import build_key
    from toolkit.rehearsal import Rehearsal
    from toolkit.rehearsal import servers as servers_module
    from toolkit.rehearsal.servers import Stage, server_environment
    from toolkit.runtime import census as census_module
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
    text = config.get("text_config", config)
    positions = int(text.get("max_position_embeddings") or 0)
    reach = Plan(contexts=contexts_for(max(longest.values(), default=0))).max_model_len
    widened = []
    if positions < reach:
        # the served model's positions (262,144 for Qwen3.6) are not the recipe's to give: the wide model takes
        # those its deepest counted step needs, as vLLM refuses a longer --max-model-len and the rotary table ends
        text["max_position_embeddings"] = reach
        widened.append(f"the wide model's max_position_embeddings {positions or '(not given)'} -> {reach} (the "
                       "contexts counted)")
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
        device_only = frozenset(v for library in loaded.recipe.base_image.gpu_libraries for v in library.reads_env)
        # a census's records depend on the patched tree's bytes and on the toolkit code that runs or starts it (the
        # runtime's census, stand-ins, references and shims; the census's plan; the server's argv and env): either
        # changed counts again. Pricing and simulating them (estimate/predict, schedule, device) do not.
        tree_digest = runtime_preflight.tree_digest(tree.paths)
        runtime_dir = Path(census_module.__file__).parent
        toolkit_files = sorted([*(p for p in runtime_dir.rglob("*.py") if "__pycache__" not in p.parts),
                                Path(count_module.__file__), Path(servers_module.__file__),
                                Path(experiment_module.__file__)])
        for name, (variant_recipe, run_config) in recipes.items():
            key = _census_key(run_config, device_only)
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
            plan = Plan(contexts=contexts_for(longest.get(name, 0)))
            if request.recount:
                by_key[key] = counted[name] = count(run_config, full_env, python, wide, tp, folder, layers,
                                                    census_layers, settings.layer_region, plan, _say)
            else:
                cached = build_key(json.dumps([key, tree_digest, config, dataclasses.asdict(plan), tp, resolved,
                                               str(python)], sort_keys=True), files=toolkit_files)
                by_key[key] = counted[name] = count_cached(cached, run_config, full_env, python, wide, tp, folder,
                                                           layers, census_layers, settings.layer_region, plan, _say)
            counted[name].changed += widened + [
                f"env {k} {env.get(k, '(not given)')} -> {v} (estimate.timed_switches: the target's choice, not this "
                "CPU's timing)" for k, v in resolved.items()]
    return counted


def _limits(loaded: LoadedRecipe, recipe: Recipe, name: str) -> Any:
    """The scheduler's budget as the variant serves (lint's reading of its args: vLLM 0.6.3's defaults where they
    are not given, chunked prefill on by itself above 32K)."""
    from toolkit.estimate.schedule import Limits
    from toolkit.lint.context import LintContext

    context = LintContext(loaded, recipe, name)
    chunked = context.chunked_prefill_effective()
    return Limits(context.max_num_batched_tokens() or 512, context.int_arg("max-num-seqs", 256) or 256, chunked)


def _served(loaded: LoadedRecipe, recipe: Recipe, name: str) -> Any:
    """What the replay's prediction needs of how the variant serves (lint's reading of its args)."""
    from toolkit.estimate.replay import COMPLETION_LIMIT_CUT, Served
    from toolkit.lint.context import LintContext

    context = LintContext(loaded, recipe, name)
    max_len = context.int_arg("max-model-len")
    if max_len is None:
        raise ToolkitError(f"variant {name} gives no --max-model-len: the replay's context refusals depend on it",
                           hint="set serve.args.max-model-len (the checkpoint's own default is not read here)")
    return Served(max_len, context.has_flag("enable-prefix-caching"),
                  any(t.id == COMPLETION_LIMIT_CUT for t in recipe.transforms))


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
    from toolkit.bench.experiment import run_config_env
    from toolkit.estimate import calibrate, predict, replay
    from toolkit.estimate.device import all_reduce_of, device_of

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
    if (request.requests is not None and request.requests < 1) or request.max_tokens < 1:
        raise ToolkitError(f"--requests {request.requests} --max-tokens {request.max_tokens}: each is 1 or more")
    recorded: list[workloads.Recorded] = []
    conversations: list[Any] = []
    left_out = None
    if request.workload == "replay":
        if request.conversations is None:
            raise ToolkitError("--workload replay needs the replay's shapes file",
                               hint="--workload replay ../shared/platform-replay/requests.csv")
        if request.concurrency != (1,):
            raise ToolkitError(f"--concurrency {','.join(map(str, request.concurrency))} with --workload replay: the "
                               "platform replays one request at a time", hint="leave --concurrency out")
        if request.requests is not None:
            raise ToolkitError("--requests with --workload replay: the platform replays every request of it",
                               hint="leave --requests out (a shorter file replays fewer)")
        recorded = workloads.recorded(request.conversations)
    else:
        conversations, left_out = workloads.build(request.workload, request.requests, request.conversations)
    max_tokens = request.max_tokens
    dropped: list[str] = []
    not_accepted: list[str] = []
    recipes = _variant_recipes(loaded, request, dropped, not_accepted)
    rundir = _rundir(request)
    started = time.monotonic()
    served: dict[str, Any] = {}
    if recorded:  # the deepest context each variant serves of the replay (a refused request runs nothing)
        served = {name: _served(loaded, variant_recipe, name) for name, (variant_recipe, _) in recipes.items()}
        longest = {name: replay.longest(recorded, served[name]) for name in recipes}
    else:
        deepest = max(r.prompt_tokens + r.max_tokens for client in predict.requests(conversations, 1, max_tokens)
                      for r in client)
        longest = dict.fromkeys(recipes, deepest)
    counted = count_variants(loaded, found, recipes, request, rundir, longest)
    rows: list[tuple[str, ...]] = []
    data: dict[str, Any] = {}
    factor = fitted.spread
    for name, (variant_recipe, run_config) in recipes.items():
        census = counted[name]
        device = device_of(recipe.hardware, _tp(loaded, request), all_reduce_of(run_config_env(run_config)))
        cost = predict.StepCost(census, device, fitted.calibration)
        own = predict.regions(cost.ops[("decode", int(cost.decode_points[0][0]))], device, fitted.calibration)
        top = sorted({r for r in own if r.count(".") <= 3}, key=lambda r: -predict.inclusive(own, r))
        breakdown = {r: round(predict.inclusive(own, r) * 1e3, 3) for r in top}
        table = {r: {"ms": round(v["seconds"] * 1e3, 4), "launches": v["launches"], "flops": v["flops"],
                     "bytes": v["bytes"]} for r, v in sorted(own.items())}
        runs = []
        if recorded:
            replayed = replay.predict(recorded, served[name],
                                      _limits(loaded, variant_recipe, name), cost)
            data[name] = {"replay": replayed.as_json()}
            runs.append(data[name]["replay"])  # what the ranking reads
            m = replayed.metrics
            slowest = [(b, v["p90_ms"]) for b, v in data[name]["replay"]["ttft_buckets"].items()]
            rows.append((name, "1", _fmt(m["ttft_p90_ms"] and m["ttft_p90_ms"] / 1e3), _fmt(m["output_tps_e2e_p10"]),
                         _fmt(m["output_tps_e2e_p50"]), _fmt(m["output_tps_agg"]), _fmt(m["official_replay_score"], 0),
                         f"{replayed.finished}/{len(recorded)} in {replayed.wall_s:,.0f} s",
                         " ".join(f"{b} {ms / 1e3:.1f}" for b, ms in slowest)))
        for concurrency in request.concurrency if not recorded else ():
            clients = predict.requests(conversations, concurrency, max_tokens)
            result = predict.predict(cost, _limits(loaded, variant_recipe, name), clients)
            runs.append(result.as_json(factor))
            m = result.metrics
            rows.append((name, str(concurrency), _fmt(m["ttft_p90_ms"] and m["ttft_p90_ms"] / 1e3),
                         _fmt(m["output_tps_e2e_p10"]), _fmt(m["output_tps_e2e_p50"]), _fmt(m["output_tps_agg"]),
                         _fmt(m["official_replay_score"], 0),
                         f"{_fmt(m['output_tps_agg'] / factor)}..{_fmt(m['output_tps_agg'] * factor)}"))
        data[name] = {
            **data.get(name, {}), "range_factor": factor, "all_reduce": device.all_reduce,
            "decode_step_ms": {str(int(b)): round(s * 1e3, 3) for b, s in cost.decode_points},
            "prefill_step_ms": {str(int(t)): round(s * 1e3, 3) for t, s in cost.prefill_points},
            # what the counted contexts say: one sequence's decode there, and a chunk's extra per token at a depth
            "context_decode_ms": {str(int(c)): round(cost.decode_at(c) * 1e3, 3) for c, _ in cost.context_points},
            "depth_ms_per_token": {str(int(d)): round(t * 1e3, 5) for d, t in cost.depth_points},
            "decode_context_priced_by": "measured" if fitted.calibration.decode_context is not None else "counted",
            "decode_breakdown_ms": breakdown, "decode_regions": table, "runs": runs, "census": str(census.folder),
            "census_changes": census.changed, "notes": census.notes}
    notes = [f"calibration {calibration_file} (fitted on {fitted.fitted_on}"
             + (f" with the census of {_with(fitted.fitted_with)}" if fitted.fitted_with else "")
             + f"); predictions range over a factor {factor:.2f} either way (the fit's largest miss)",
             (f"workload replay: the {len(recorded)} requests of {request.conversations}, one at a time, inside "
              f"{replay.BUDGET_S:,.0f} s (the platform's budget); a request not served counts as a failure"
              if recorded else
              f"workload {request.workload}: {len(conversations)} request(s), max_tokens {max_tokens}, prompt lengths "
              f"from their text at {predict.CHARS_PER_TOKEN:g} characters a token"),
             f"counted at the target's widths in {time.monotonic() - started:.0f} s; censuses in {rundir}"]
    if left_out:
        notes.append(left_out)
    for name, entry in data.items():
        if not entry["depth_ms_per_token"]:
            notes.append(f"{name}: no context counted (the workload's sequences are short): a step costs what it "
                         "does at the census's short contexts")
            continue
        decodes = ", ".join(f"{c} {ms:.1f}" for c, ms in entry["context_decode_ms"].items())
        depths = ", ".join(f"{d} {ms:.4f}" for d, ms in entry["depth_ms_per_token"].items())
        priced = ("the calibration's measured decode against context prices a decode's; the count's is this"
                  if entry["decode_context_priced_by"] == "measured" else "they price a decode's context")
        notes.append(f"{name}: counted contexts: one sequence's decode step, ms, at {decodes} tokens ({priced}); a "
                     f"prefill chunk's extra ms per token at a depth of {depths} tokens (its prefix attention)")
    if recorded:
        for name, entry in data.items():
            notes += [f"{name}: replay: {said}" for said in entry["replay"]["said"]]
    if fitted.unidentified:
        notes.append(f"not identified by the calibration's records (at a bound of its range, used as it is): "
                     f"{', '.join(fitted.unidentified)}")
    if dropped:
        notes.append(f"{len(dropped)} variant(s) left out, as `toolkit variants` drops them (vLLM would refuse to "
                     "start them): " + ", ".join(dropped))
    notes += [f"estimated, but not a submission: {said}" for said in not_accepted]
    for name, entry in data.items():
        steps = ", ".join(f"{b} seq {ms:.1f} ms" for b, ms in entry["decode_step_ms"].items())
        chunks = ", ".join(f"{t} tok {ms:.0f} ms" for t, ms in entry["prefill_step_ms"].items())
        notes.append(f"{name}: decode step {steps}; prefill {chunks}; TP all-reduce {entry['all_reduce']}")
        shown = list(entry["decode_breakdown_ms"].items())[:8]
        parts = ", ".join(f"{r.removeprefix('step.')} {ms:.1f}" for r, ms in shown)
        notes.append(f"{name}: decode step (1 seq) by region, ms: {parts}")
    for name, census in counted.items():
        if census.changed and name == next(iter(counted)):
            notes.append("the census serves the run config's argv with: " + "; ".join(census.changed)
                         + "; the model at its widths with one full-attention interval of layers, dummy weights")
    notes += _ranking(data, request.concurrency, factor)
    columns = ("variant", "c", "TTFT P90 s", "TPS P10", "TPS P50", "agg TPS", "score") + (
        ("finished in budget", "TTFT P90 s by bucket") if recorded else ("agg TPS range",))
    report = Report("estimate", str(loaded.path), notes=tuple(notes), columns=columns,
                    rows=tuple(rows), extra={"variants": data, "calibration": calibrate.to_json(fitted),
                                               "not_a_submission": not_accepted})
    return dataclasses.replace(report, exit_code=EXIT_OK)


def _with(fitted_with: dict[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in fitted_with.items())


def fit_on(counted: Any, device: Any, records: Path, timings: Path, fitted_with: dict[str, str]) -> Any:
    """The calibration fitted on `records` with a variant's census (its decode step of one sequence), its all-reduce
    implementations and decode against context decided by the target's `timings`."""
    from toolkit.estimate import calibrate

    reduces, decode_context, checks = calibrate.timings(timings, device.ranks)
    if device.all_reduce not in reduces:
        raise ToolkitError(f"{timings} times no {device.all_reduce} all-reduce, the one the records' variant ran",
                           hint="the variant's env selects it (ENABLE_CUSTOM_IPC): time that implementation")

    decode = [s for s in counted.steps if s.decodes and not s.prefills]
    if not decode:
        raise ToolkitError(f"the census in {counted.folder} counted no decode step to fit on")
    one = [s for s in decode if len(s.decodes) == 1] or decode
    # rank 0's fewest launches: a path's first call may do one-off work (as StepCost prices)
    steady = min(one, key=lambda s: sum(op.calls for op in s.ranks[min(s.ranks)]))
    fitted = calibrate.fit(steady, counted.entries.get(calibrate.BUCKET, {}), device, calibrate.measured(records),
                           str(records), reduces, decode_context)
    fitted.fitted_with = {**fitted_with, "all_reduce": device.all_reduce}
    fitted.checks = checks
    return fitted


def _fitted_with(loaded: LoadedRecipe, variant: str, run_config: str) -> dict[str, str]:
    """What a calibration's census served: the variant, each source's pinned commit, the dtype."""
    import yaml

    from toolkit.bench import experiment

    argv = [str(a) for a in yaml.safe_load(run_config).get("command") or []]
    pins = {s.name: s.commit for s in load_recipe(loaded.path).recipe.sources}
    sources = {s.name: s.commit[:12] + ("" if s.commit == pins.get(s.name) else
                                        f" (--source for the pin {pins.get(s.name, '?')[:12]})")
               for s in loaded.recipe.sources}
    return {"variant": variant, **{f"source {k}": v for k, v in sources.items()},
            "dtype": experiment.flag_value(argv, "--dtype") or "auto"}


def _calibrate(loaded: LoadedRecipe, found: dict[str, Path], request: EstimateRequest) -> Report:
    from toolkit.bench.experiment import run_config_env
    from toolkit.estimate import calibrate
    from toolkit.estimate.device import all_reduce_of, device_of

    records = request.calibrate
    assert records is not None
    if request.write is not None and request.write.exists():
        raise ToolkitError(f"--write {request.write} exists; nothing was fitted (a calibration never replaces a file)",
                           hint="give a new path, then name it under estimate.calibration")
    if request.all_variants:
        raise ToolkitError("--calibrate fits on one variant's census: the configuration the records were taken "
                           "with", hint="--variant NAME (default: the base)")
    if request.timings is None:
        raise ToolkitError("--calibrate needs the target's timings (--timings FILE): the all-reduce's calls (the "
                           "records' synchronise swallows its latency) and the decode against its context",
                           hint="--timings benchmarks/data/target-timings.yaml (TARGET_MEASUREMENTS.md section 4)")
    calibrate.measured(records)  # refused before a census runs
    calibrate.timings(request.timings, _tp(loaded, request))
    recipes = _variant_recipes(loaded, request)
    rundir = _rundir(request)
    counted = count_variants(loaded, found, recipes, request, rundir, {})  # the decode regions the records time
    [(name, (_, run_config))] = recipes.items()
    device = device_of(loaded.recipe.hardware, _tp(loaded, request), all_reduce_of(run_config_env(run_config)))
    fitted = fit_on(counted[name], device, records, request.timings, _fitted_with(loaded, name, run_config))
    rows = tuple((region, _fmt(v["measured_ms"], 3), _fmt(v["fitted_ms"], 3),
                  _fmt(v["fitted_ms"] / v["measured_ms"] if v["measured_ms"] else None, 2))
                 for region, v in fitted.regions.items())
    c = fitted.calibration
    reduces = "; ".join(f"{n} {r.latency_us:.1f} us + ring traffic at {r.gbs:.2f} GB/s"
                        for n, r in c.all_reduce.items())
    notes = [f"fitted on {records} with the census of {_with(fitted.fitted_with)} ({rundir}): launch "
             f"{c.launch_us:.1f} us, bandwidth fraction {c.bandwidth_fraction:.2f}, profiler synchronise "
             f"{fitted.sync_us:.1f} us (left out of predictions), compute fraction {c.compute_fraction:.2f} (a "
             f"prior); largest miss a factor {fitted.spread:.2f}",
             f"all-reduce, decided by {request.timings}'s smallest and largest buffers: {reduces}"]
    for impl, check in fitted.checks["all_reduce"].items():
        for elements, v in check["predicted"].items():
            notes.append(f"  {impl} at {elements} elements: measured {v['measured_ms']:.4f} ms, predicted "
                         f"{v['predicted_ms']:.4f} ms")
    context = fitted.checks.get("decode_context")
    if context:
        notes.append(f"decode against its context, decided by {context['decided_by']}")
        notes += [f"  at {c} tokens: measured {v['measured_tok_s']:.3f} tok/s, predicted {v['predicted_tok_s']:.3f}"
                  for c, v in context["predicted"].items()]
    if fitted.unidentified:
        notes.append(f"not identified by the records (at a bound of its range): {', '.join(fitted.unidentified)}")
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

