"""rehearse: the submission's own server command answers the official requests on a CPU (toolkit/rehearsal/)."""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.commands.common import Inputs, chosen_variants, pinned, run_folder
from toolkit.errors import EXIT_FAILED, EXIT_OK, ToolkitError
from toolkit.recipe import LoadedRecipe, load_recipe
from toolkit.results import Finding, Report
from toolkit.runtime.preflight import Tree

if TYPE_CHECKING:
    from toolkit.rehearsal import Rehearsal


@dataclass(frozen=True)
class RehearseRequest:
    recipe: Path
    inputs: Inputs = field(default_factory=Inputs)
    variant: str | None = None  # one variant; default: the base
    all_variants: bool = False
    rootfs: Path | None = None  # vendor roots the recipe was applied to (default: a patched copy of the reference)
    model_config: Path | None = None  # the served model's config.json (and index): the tiny model takes its names
    tp: int | None = None  # default: 2 where the recipe serves TP > 1, else 1
    output: Path | None = None  # RUNDIR: the servers' logs and records (default: a new temporary folder, kept)
    port: int | None = None  # default: a free one
    memory_gb: float | None = None  # the emulated card's memory (default: rehearse.DEVICE_MEMORY_GB)
    run_configs: dict[str, str] = field(default_factory=dict)  # variant -> run config text (build --rehearse)
    only: tuple[str, ...] = ()  # of the chosen variants, these (build --rehearse: those it wrote)
    checks: tuple[str, ...] = ()  # of the request checks, these (default: all; the start and weights always)
    apply_to_rootfs: bool = False  # the rootfs holds the image's roots as they are: the recipe is applied to a copy
    model: Path | None = None  # a checkpoint folder served instead of the tiny model built from the recipe


def served_tp(loaded: LoadedRecipe) -> int | None:
    """The recipe's own tensor-parallel size (None: not set)."""
    from toolkit.bench.experiment import flag_value
    from toolkit.submission.render import argv

    served = flag_value(argv(loaded.recipe), "--tensor-parallel-size")
    return int(served) if served is not None else None


def _tp(loaded: LoadedRecipe, asked: int | None) -> int:
    if asked is not None:
        if asked < 1:
            raise ToolkitError(f"--tp {asked}: a tensor-parallel size is 1 or more")
        return asked
    served = served_tp(loaded)
    return 2 if served is not None and served > 1 else 1


def _rundir(request: RehearseRequest) -> Path:
    return run_folder(request.output, "toolkit-rehearse-", "the rehearsal")


def refuse_unapplied(loaded: LoadedRecipe, found: dict[str, Path], request: RehearseRequest) -> None:
    """A tree without some of the recipe's transforms serves another submission (a server that dies on a flag a
    missing transform adds, or worse, starts): refused before anything is built or started, naming them."""
    from toolkit.trial import require_applied, require_complete

    if request.rootfs is not None and not request.apply_to_rootfs:
        require_applied(loaded, found, request.rootfs, "rehearse",
                        f"`toolkit apply {request.recipe} --rootfs {request.rootfs}` first, or rehearse a copy with "
                        "the recipe applied (`toolkit rehearse RECIPE --rootfs DIR --apply-to-copy`, as build "
                        "--rootfs does)")
        return
    require_complete(loaded, found, "rehearse")


def rehearse(request: RehearseRequest) -> Report:
    """Exit 0 only when every check of every variant holds."""
    from toolkit import rehearsal
    from toolkit.bench.serve import port_in_use
    from toolkit.inputs import cache_dir
    from toolkit.lint import lint
    from toolkit.runtime import preflight as runtime_preflight
    from toolkit.runtime import tiny_model
    from toolkit.runtime.env import runtime
    from toolkit.submission.render import render

    rehearsal.refuse_unknown_checks(request.checks)
    loaded, found = pinned(load_recipe(request.recipe), request.inputs)
    variants = [v for v in chosen_variants(loaded, request.variant, request.all_variants)
                if not request.only or v.name in request.only]
    if request.model is not None and not (request.model / "config.json").is_file():
        raise ToolkitError(f"--model {request.model}: no config.json there; a checkpoint folder is expected",
                           hint="leave --model out to rehearse with the tiny model built from the recipe")
    if loaded.recipe.model is None and request.model_config is None and request.model is None:
        raise ToolkitError("rehearse needs the served model's shape for its tiny model",
                           hint="add a `model:` section to the recipe, or pass --model-config DIR")
    refuse_unapplied(loaded, found, request)
    tp = _tp(loaded, request.tp)
    recipe_tp = served_tp(loaded)
    if request.port is not None and port_in_use(request.port):
        raise ToolkitError(f"--port {request.port}: already taken on 127.0.0.1, nothing was started",
                           hint="stop what listens there, or leave --port out (a free port is chosen)")
    rundir = _rundir(request)
    python = runtime()
    started = time.monotonic()
    if request.model is not None:
        model = request.model.resolve()  # the servers run in the run folder: a relative path would not reach it
    else:
        spec = tiny_model.tiny_spec(loaded.recipe.model, tp, request.model_config, recipe_tp)
        model = tiny_model.build(spec, python, cache_dir() / "tiny-models")
    rehearsals = []
    not_accepted = [f"{v.name}: rehearsed, but not a submission: {i.rule}: {i.message}" for v in variants
                    for i in lint(loaded, v.apply(loaded.recipe), variant=v.name,
                                  for_submission=False).not_a_submission]
    with tempfile.TemporaryDirectory(prefix="toolkit-rehearse-tree-") as tmp:
        work = Path(tmp)
        tree: Tree
        image: Path | None
        if request.rootfs is not None and request.apply_to_rootfs:
            image = work / "image"
            tree = runtime_preflight.patched_copy(loaded, found, work, request.rootfs,
                                                  dict(request.inputs.package_roots), image=image)
        elif request.rootfs is not None:
            tree = runtime_preflight.given_tree(loaded, request.rootfs, dict(request.inputs.package_roots), work)
            image = request.rootfs
        else:
            image = work / "image"
            tree = runtime_preflight.patched_copy(loaded, found, work, image=image)
        print(f"rehearse: {len(variants)} variant(s) on {tree.where}, the tiny model {model}, TP {tp}; "
              f"logs in {rundir}", file=sys.stderr, flush=True)
        for variant in variants:
            name = variant.name
            recipe = variant.apply(loaded.recipe)
            run_config = request.run_configs.get(name) or render(recipe, loaded.path.name, name).run_config
            rehearsals.append(rehearsal.rehearse(
                recipe, name, run_config, tree, python, model, tp, rundir / name, image=image,
                memory_gb=request.memory_gb or rehearsal.DEVICE_MEMORY_GB, port=request.port,
                only=request.checks))
    return report(loaded, rehearsals, tree.where, time.monotonic() - started, not_accepted)


def report(loaded: LoadedRecipe, rehearsals: list[Rehearsal], where: str, seconds: float,
           not_accepted: list[str]) -> Report:
    """One row per check ([ok]/[FAIL] and why), the substitutions, shims, references and timings as notes; what only
    the platform's submission requires, found by lint, too (the checks ran all the same)."""
    rows: list[tuple[str, ...]] = []
    findings: list[Finding] = []
    notes = [f"rehearsed on {where}, {seconds:.0f} s", *not_accepted]
    for r in rehearsals:
        for check in r.checks:
            rows.append((r.variant, check.name, f"[{check.result}]", check.detail))
            if not check.ok:
                findings.append(Finding(check.name, r.variant, "", check.detail))
        notes.extend(f"{r.variant}: {s.flag} {s.served if s.served is not None else '(not given)'} -> {s.rehearsed} "
                     f"({s.why})" for s in r.substitutions)
        if r.shims:
            notes.append(f"{r.variant}: device shims (the image's GPU, on this CPU): {', '.join(r.shims)}")
        if r.references:
            notes.append(f"{r.variant}: the vendor's GPU library computed by the CPU references: " + ", ".join(
                f"{name} x{count}" for name, count in sorted(r.references.items())))
        timing = [f"ready after {r.ready_s:.1f} s" if r.ready_s is not None else "",
                  f"first token after {r.first_token_s * 1000:.0f} ms" if r.first_token_s is not None else ""]
        if any(timing):
            notes.append(f"{r.variant}: on this CPU (no measure of the platform's speed): "
                         + ", ".join(t for t in timing if t))
        notes.append(f"{r.variant}: server logs: {', '.join(r.logs)}")
    good = sum(1 for r in rehearsals if r.ok)
    notes.append(f"{good} of {len(rehearsals)} variant(s) pass every check" + (
        "" if good == len(rehearsals) else "; the failed checks say why (exit 1)"))
    result = Report("rehearse", str(loaded.path), findings=tuple(findings), notes=tuple(notes),
                    columns=("variant", "check", "result", "detail"), rows=tuple(rows),
                    extra={"variants": [r.as_json() for r in rehearsals]})
    return dataclasses.replace(result, exit_code=EXIT_OK if result.ok and good == len(rehearsals) else EXIT_FAILED)
