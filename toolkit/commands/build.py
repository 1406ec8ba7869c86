"""build and check: the submission repository the platform builds, and its check."""

from __future__ import annotations

import dataclasses
import shlex
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.commands.common import Inputs, chosen_variants, finished, pinned
from toolkit.commands.progress import PROGRESS
from toolkit.errors import EXIT_CANNOT_START, EXIT_FAILED
from toolkit.lint import lint
from toolkit.recipe import LoadedRecipe, load_recipe
from toolkit.results import Report, Severity, State
from toolkit.submission.build import build as build_submission
from toolkit.submission.build import build_all_variants, check_outdir, files_by_kind, server_command, used_sources
from toolkit.submission.build import push as push_submission
from toolkit.submission.check import verify_submission
from toolkit.trial import try_recipe
from toolkit.variants import find as find_variant


@dataclass(frozen=True)
class BuildRequest:
    recipe: Path
    output: Path
    inputs: Inputs = field(default_factory=Inputs)
    variant: str | None = None  # build one variant
    all_variants: bool = False  # the base plus one run config per variant that lints clean
    branches: bool = False  # with all_variants: one branch per variant too
    push: str | None = None  # a git remote to push the branch(es) to
    rootfs: Path | None = None  # try the transforms on these real vendor roots instead of the CoreX-like tree
    force: bool = False  # replace OUTDIR if it is an unchanged previous submission of this tool
    image: str | None = None  # also docker-build the image with this tag, verify inside, compare with a host apply
    rehearse: bool = False  # then rehearse the written run config(s) on a CPU; a failed rehearsal fails the build


def build(request: BuildRequest) -> Report:
    """Lint, try every transform, preflight (when the CPU runtime is here), write and commit, check."""
    loaded = load_recipe(request.recipe)
    outdir = request.output
    started = time.monotonic()
    notes: list[str] = []
    previous = check_outdir(outdir, loaded, request.force)  # before anything slow: a refused OUTDIR is said at once
    PROGRESS.untouched = (f"{outdir} was left as it was" + (f" (the previous submission, commit {previous[:12]})"
                          if previous else "") + "; the half-written tree beside it was removed")
    loaded, found = pinned(loaded, request.inputs, fetch=True)
    given = dict(request.inputs.package_roots)
    trial = try_recipe(loaded, found, request.rootfs, given)
    if not trial.ok:
        # the platform's docker build shows no log: a transform that cannot apply must stop the build here
        return dataclasses.replace(Report("build", str(loaded.path), trial.results, notes=(
            f"tried every transform on {trial.where} before writing: {len(trial.drifted)} DRIFTED result(s)",
            *trial.notes, f"nothing was written; {outdir} was left as it was")), exit_code=EXIT_FAILED)
    preflight_notes, refused = _preflight(loaded, found, request)
    if refused is not None:
        return dataclasses.replace(refused, exit_code=EXIT_CANNOT_START)
    notes.extend(preflight_notes)
    rows: list[tuple[str, ...]] = []
    if request.all_variants:
        grid = build_all_variants(loaded, outdir, force=request.force, branches=request.branches, pinned=found)
        built, branches = grid.built, grid.branches
        rows = [(v.name, "written", v.describe()) for v in grid.kept]
        rows += [(v.name, "DROPPED", "; ".join(f"{e.rule}: {e.message}" for e in errs)) for v, errs in grid.dropped]
        notes.append(f"{len(grid.kept)} variant(s) kept (run configs under variants/), {len(grid.dropped)} dropped "
                     "by lint" + (f"; {len(branches) - 1} variant branch(es)" if request.branches else ""))
        recipe = loaded.recipe
    else:
        recipe = find_variant(loaded.recipe, request.variant).apply(loaded.recipe) if request.variant else \
            loaded.recipe
        built = build_submission(loaded, recipe, outdir, variant=request.variant, force=request.force, pinned=found)
        branches = [built.branch]
    build_seconds = time.monotonic() - started
    PROGRESS.done.append(f"{outdir} holds the complete new submission (commit {built.commit[:12]})"
                         + (f", which replaced the previous one (commit {previous[:12]})" if previous else ""))
    if previous:
        notes.append(f"replaced the previous submission in {outdir} (commit {previous[:12]}, unchanged since "
                     "toolkit built it); nothing else was touched")
    tried = sum(1 for r in trial.results if r.state is not State.GATED_OFF)
    notes.append(f"tried the transforms on {trial.where} before writing: {tried} result(s), none DRIFTED")
    notes.extend(trial.notes)
    for source in used_sources(loaded.recipe):
        bundled = (outdir / "toolkit_payload" / "sources" / source.name).is_dir()
        notes.append(f"adapter source {source.name}: " + (
            f"bundled at {source.commit} (the image build needs no git and no network for it)" if bundled else
            f"NOT BUNDLED: THE IMAGE BUILD MUST CLONE {source.git} at {source.commit}, so the platform's builder "
            f"needs git and network (it may have neither, and shows no log); "
            + ("sources[].fetch is image" if source.fetch == "image" else "this host could not reach it")
            + f"; --source {source.name}=PATH bundles it"))
    if request.push:
        push_submission(outdir, request.push, branches)
        notes.append(f"pushed {', '.join(branches)} to {request.push}")
        PROGRESS.done.append(notes[-1])
    verified = verify_submission(outdir)
    extra: dict[str, object] = {}
    if request.image and verified.ok:
        from toolkit.submission.image import image_flow  # the Docker SDK is needed only here

        image_started = time.monotonic()
        extra = image_flow(outdir, request.image)
        notes.append(f"image {request.image}: built, verified inside, {extra['compared_files']} patched file(s) "
                     f"byte-identical to a host apply ({time.monotonic() - image_started:.1f} s)")
    kinds = files_by_kind(outdir)
    command = server_command(outdir)
    notes.insert(0, f"wrote {outdir}: commit {built.commit[:12]} on {', '.join(branches)}, {built.files} file(s) "
                    f"({', '.join(f'{n} {k}' for k, n in kinds.items())}), built in {build_seconds:.1f} s")
    notes.append(f"server command: {shlex.join(command)}")
    warnings = tuple(i for i in lint(loaded, recipe, variant=request.variant).issues
                     if i.severity is not Severity.INFO or i.rule == "kv-cache")
    next_step = (f"next: push it (`toolkit build ... --push URL`, or `git -C {outdir} push URL main`) and submit "
                 "the repository URL" if not request.push else "next: submit the repository URL you pushed to")
    closing = (next_step + f"; `toolkit check {outdir}` checks it again at any time",) if verified.ok else (
        "next: fix the findings above (the submission would not build or start), then build again",)
    if request.rehearse and verified.ok:
        rehearsed = _rehearse(loaded, outdir, request)
        extra["rehearsal"] = rehearsed.as_json()
        if not rehearsed.ok:
            closing = (f"THE REHEARSAL FAILED: the submission in {outdir} was written and stays for inspection, but "
                       "its server does not answer as the platform needs (the failed checks above say why)",)
            return dataclasses.replace(finished(Report(
                "build", str(loaded.path), trial.results, findings=(*verified.findings, *rehearsed.findings),
                notes=(*notes, *rehearsed.notes, *closing), columns=rehearsed.columns, rows=rehearsed.rows,
                extra={"outdir": str(outdir), "commit": built.commit, **extra})), exit_code=EXIT_FAILED)
        notes.extend(f"rehearsal of {variant}: {result} {check}: {detail}" for variant, check, result, detail in
                     rehearsed.rows)
    # the trial's state per transform and root, as apply reports them on the same trees (one verdict per input)
    return finished(Report(
        "build", str(loaded.path), trial.results, findings=verified.findings, notes=(*notes, *verified.notes, *closing),
        issues=(*verified.issues, *warnings), columns=("variant", "status", "detail") if rows else (),
        rows=tuple(rows),
        extra={"outdir": str(outdir), "commit": built.commit, "tree": built.tree, "branches": branches,
               "files_by_kind": kinds, "server_command": command,
               "trial": {"where": trial.where, "untried": dict(trial.untried)}, **extra}))


def _preflight(loaded: LoadedRecipe, found: dict[str, Path], request: BuildRequest) -> tuple[list[str], Report | None]:
    """Preflight of what the build writes, when the CPU runtime is here (a Report: refused, nothing written)."""
    from toolkit.runtime import preflight
    from toolkit.runtime.env import built

    python = built()
    if python is None:
        return ["preflight not run: no CPU runtime here yet (`toolkit preflight RECIPE` builds it once, about a "
                "minute; later builds then run the variants through the vendor's own code)"], None
    variants = chosen_variants(loaded, request.variant, request.all_variants)
    # what lint refuses is refused by the build with lint's message; preflight checks what would be written
    variants = [v for v in variants if not lint(loaded, v.apply(loaded.recipe), variant=v.name).refusals]
    if not variants:
        return [], None
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="toolkit-preflight-tree-") as tmp:
        outcomes, _, cached = preflight.cached_run(loaded, variants, found, python, Path(tmp), request.rootfs,
                                                   dict(request.inputs.package_roots))
    how = "remembered from an earlier run" if cached else f"{time.monotonic() - started:.1f} s"
    if all(o.starts for o in outcomes):
        unchecked = sorted({n for o in outcomes for n in o.not_checked})
        left = f"; not checked here, left to the in-image step: {'; '.join(unchecked)}" if unchecked else ""
        where = f"a patched copy of the vendor roots under {request.rootfs}" if request.rootfs else \
            f"a patched copy of {loaded.recipe.vendor.reference} (CoreX-like)"
        said = (f"preflight: {len(outcomes)} variant(s) start in the patched vLLM's own config code, on {where} "
                f"({how}){left}")
        return [said], None
    report = preflight.report(loaded, outcomes, f"preflight before writing ({how})")
    return [], dataclasses.replace(report, verb="build", notes=(*report.notes, "nothing was written"))


def _rehearse(loaded: LoadedRecipe, outdir: Path, request: BuildRequest) -> Report:
    """`toolkit rehearse` of the run config(s) the build wrote, on the same trees the trial used."""
    from toolkit.commands.rehearse import RehearseRequest, rehearse

    configs = {}
    for variant in chosen_variants(loaded, request.variant, request.all_variants):
        written = outdir / ("variants/" + variant.name if request.all_variants and variant.name != "base" else "")
        if (written / "computility-run.yaml").is_file():  # a variant lint dropped has none
            configs[variant.name] = (written / "computility-run.yaml").read_text(encoding="utf-8")
    return rehearse(RehearseRequest(loaded.path, request.inputs, request.variant, request.all_variants,
                                    request.rootfs, apply_to_rootfs=True, run_configs=configs,
                                    only=tuple(configs)))


def check(outdir: Path) -> Report:
    """A submission repository as the platform will build it: LF, linters, run config, payload."""
    return finished(verify_submission(outdir))
