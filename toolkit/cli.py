"""The `toolkit` command: one small function per verb, each returning an exit code."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import git

from toolkit import __version__
from toolkit.engine import Engine, commit, make_lock
from toolkit.errors import EXIT_FAILED, EXIT_OK, EXIT_SUPERSEDED, ToolkitError
from toolkit.lint import lint
from toolkit.recipe import LoadedRecipe, json_schema, load_recipe
from toolkit.report import emit
from toolkit.results import Report, Severity, State
from toolkit.sources import Root, reference_root, resolve_trees, rootfs_roots
from toolkit.submission import build as build_submission
from toolkit.submission import (
    build_all_variants,
    check_outdir,
    files_by_kind,
    replaceable_problem,
    server_command,
    used_sources,
)
from toolkit.submission import push as push_submission
from toolkit.submission_verify import verify_submission
from toolkit.trial import try_recipe
from toolkit.variants import expand as expand_variants
from toolkit.variants import find as find_variant
from toolkit.verify import verify_tree

EPILOG = """\
exit codes:
  0  every transform APPLIED, ALREADY_APPLIED, SUPERSEDED or GATED_OFF (verify: no findings)
  1  a transform DRIFTED, or verify found a problem; nothing was written
  2  bad recipe, bad arguments, missing files
  3  input drift: the vendor roots differ from each other, from the lock, or from vendor.version
  4  --strict only: a transform is SUPERSEDED (the patch may be removable)

examples:
  toolkit build recipes/bi100-qwen36.yaml -o ../submission      # the repository the platform builds
  toolkit verify ../submission                                   # LF, linters, run config, payload
  toolkit apply recipes/bi100-qwen36.yaml --rootfs /            # inside the image
  toolkit apply recipes/bi100-qwen36.yaml --rootfs ./rootfs --json
  toolkit diff recipes/bi100-qwen36.yaml --reference --stat      # against vllm==0.6.3.post1 from PyPI
  toolkit verify recipes/bi100-qwen36.yaml --rootfs ./rootfs
  toolkit lint recipes/bi100-qwen36.yaml                         # exit 0 clean, 1 warnings (--strict), 2 errors
  toolkit variants recipes/bi100-qwen36.yaml                     # the experiment grid, impossible ones dropped
"""


@dataclasses.dataclass
class Progress:
    """What the running verb has done that an interrupt cannot undo, so that the message tells the truth."""

    untouched: str = "nothing was written"
    done: list[str] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        return "; ".join(self.done) if self.done else self.untouched


PROGRESS = Progress()


def _trees(loaded: LoadedRecipe, args: argparse.Namespace) -> dict[str, Path]:
    overrides = {}
    for item in getattr(args, "source", None) or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ToolkitError(f"--source {item!r}: expected NAME=PATH",
                               hint="e.g. --source qwen36-adapter=../qwen36_01")
        overrides[name] = path
    return resolve_trees(loaded.recipe, loaded.path.parent, overrides)


def _roots(loaded: LoadedRecipe, args: argparse.Namespace) -> tuple[list[Root], Path | None]:
    if getattr(args, "reference", None):
        spec = loaded.recipe.vendor.reference if args.reference is True else args.reference
        base = loaded.recipe.base_image
        return [reference_root(spec, base.python, base.platform)], None
    if not args.rootfs:
        raise ToolkitError("no vendor tree given", hint="pass --rootfs DIR (a folder laid out like the image)")
    rootfs = Path(args.rootfs)
    return rootfs_roots(loaded.recipe, rootfs), rootfs


def _read_lock(path: str | None) -> dict[str, object] | None:
    if path is None:
        return None
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ToolkitError(f"lock file {path} not found",
                           hint="create it with `toolkit apply --write-lock FILE`") from None
    except json.JSONDecodeError as exc:
        raise ToolkitError(f"{path}:{exc.lineno}: lock file is not JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise ToolkitError(f"{path}: a lock is a JSON object")
    return data


def _exit(report: Report, strict: bool = False) -> int:
    if not report.ok:
        return EXIT_FAILED
    if strict and report.count(State.SUPERSEDED):
        return EXIT_SUPERSEDED
    return EXIT_OK


def cmd_apply(args: argparse.Namespace) -> int:
    loaded = load_recipe(args.recipe)
    roots, rootfs = _roots(loaded, args)
    engine = Engine(loaded, roots, rootfs, lock=_read_lock(args.check_lock), trees=_trees(loaded, args))
    plan = engine.run()
    written: list[str] = []
    PROGRESS.untouched = "nothing was written: the writes are all-or-nothing and were rolled back or never began"
    if plan.ok and not args.dry_run:
        commit(plan.ops)
        written = [str(op.path) for op in plan.ops]
        PROGRESS.done.append(f"the apply completed: {len(written)} path(s) written in the vendor roots")
    if plan.ok and args.write_lock:
        lock = make_lock(plan, loaded.recipe.name, loaded.recipe.vendor.package)
        Path(args.write_lock).write_text(json.dumps(lock, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        PROGRESS.done.append(f"lock written to {args.write_lock}")
    notes = [f"{label}: {loaded.recipe.vendor.package} {v}" for label, v in plan.versions.items()]
    if not plan.ok:
        notes.append("nothing was written: fix the DRIFTED transforms (or the vendor tree) and run again")
    elif args.dry_run:
        notes.append(f"dry run: {len(plan.ops)} write(s) planned, none made")
    else:
        notes.append(f"{len(written)} path(s) written")
    report = Report("apply", str(loaded.path), tuple(plan.results), notes=tuple(notes),
                    extra={"written": written, "dry_run": bool(args.dry_run)})
    emit(report, as_json=args.json)
    return _exit(report, args.strict)


def cmd_diff(args: argparse.Namespace) -> int:
    loaded = load_recipe(args.recipe)
    roots, rootfs = _roots(loaded, args)
    engine = Engine(loaded, roots, rootfs, check_version=not args.reference, trees=_trees(loaded, args))
    plan = engine.run()
    first = roots[0].label
    steps = [s for s in plan.steps if s.root in (first, "/")]
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
    check_outdir(outdir, loaded, args.force)  # before anything slow: a refused OUTDIR is said at once
    previous = None if replaceable_problem(outdir) else str(git.Repo(outdir).head.commit.hexsha)
    PROGRESS.untouched = (f"{outdir} was left as it was" + (f" (the previous submission, commit {previous[:12]})"
                          if previous else "") + "; the half-written tree beside it was removed")
    trees = _trees(loaded, args)
    trial = try_recipe(loaded, trees, Path(args.rootfs) if args.rootfs else None)
    if not trial.ok:
        # the platform's docker build shows no log: a transform that cannot apply must stop the build here
        report = Report("build", str(loaded.path), trial.results, notes=(
            f"tried every transform on {trial.where} before writing: {len(trial.drifted)} DRIFTED result(s)",
            *trial.notes, f"nothing was written; {outdir} was left as it was"))
        emit(report, as_json=args.json)
        return EXIT_FAILED
    rows: list[tuple[str, ...]] = []
    if args.all_variants:
        grid = build_all_variants(loaded, outdir, force=args.force, branches=args.branches, trees=trees)
        built, branches = grid.built, grid.branches
        rows = [(v.name, "written", v.describe()) for v in grid.kept]
        rows += [(v.name, "DROPPED", "; ".join(f"{e.rule}: {e.message}" for e in errs)) for v, errs in grid.dropped]
        notes.append(f"{len(grid.kept)} variant(s) kept (run configs under variants/), {len(grid.dropped)} dropped "
                     "by lint" + (f"; {len(branches) - 1} variant branch(es)" if args.branches else ""))
        recipe = loaded.recipe
    else:
        recipe = find_variant(loaded.recipe, args.variant).apply(loaded.recipe) if args.variant else loaded.recipe
        built = build_submission(loaded, recipe, outdir, variant=args.variant, force=args.force, trees=trees)
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
        notes.append(f"adapter source {source.name}: " + (f"bundled at {source.commit}" if bundled else
                     f"NOT bundled; the image build clones {source.git} and checks out {source.commit} "
                     f"(needs git and network in the builder; --source {source.name}=PATH bundles it)"))
    if args.push:
        push_submission(outdir, args.push, branches)
        notes.append(f"pushed {', '.join(branches)} to {args.push}")
        PROGRESS.done.append(notes[-1])
    verified = verify_submission(outdir)
    extra: dict[str, object] = {}
    if args.image and verified.ok:
        from toolkit.image import image_flow  # the Docker SDK is needed only here

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
    closing = (next_step + f"; `toolkit verify {outdir}` checks it again at any time",) if verified.ok else (
        "next: fix the findings above (the submission would not build or start), then build again",)
    report = Report("build", str(loaded.path), findings=verified.findings, notes=(*notes, *verified.notes, *closing),
                    issues=warnings, columns=("variant", "status", "detail") if rows else (), rows=tuple(rows),
                    extra={"outdir": str(outdir), "commit": built.commit, "tree": built.tree,
                           "branches": branches, "files_by_kind": kinds, "server_command": command,
                           "trial": {"where": trial.where, "untried": dict(trial.untried)}, **extra})
    emit(report, as_json=args.json)
    return _exit(report)


def cmd_vendor_pull(args: argparse.Namespace) -> int:
    from toolkit.image import vendor_pull

    loaded = load_recipe(args.recipe)
    out = Path(args.output)
    if out.exists() and any(out.iterdir()):
        raise ToolkitError(f"{out} is not empty", hint="pull into a new folder")
    roots = vendor_pull(loaded, out, args.image)
    report = Report("vendor pull", str(loaded.path), notes=(f"{len(roots)} root(s) extracted into {out}: "
                                                          + ", ".join(roots),), extra={"roots": roots})
    emit(report, as_json=args.json)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    if Path(args.recipe).is_dir():
        report = verify_submission(Path(args.recipe))
        emit(report, as_json=args.json)
        return _exit(report)
    loaded = load_recipe(args.recipe)
    roots, rootfs = _roots(loaded, args)
    report = verify_tree(loaded, roots, rootfs, _trees(loaded, args))
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
    result = lint(loaded, recipe, variant=args.variant, rootfs=Path(args.rootfs) if args.rootfs else None)
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
        p.add_argument("--source", action="append", metavar="NAME=PATH",
                       help="a local checkout of a declared source (its pinned commit is used)")
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
    p.add_argument("--source", action="append", metavar="NAME=PATH",
                   help="bundle a declared source from this local checkout (at its pinned commit) instead of "
                   "fetching it at image build")
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

    p = sub.add_parser("vendor", help="`vendor pull`: extract the recipe's vendor roots from the base image")
    vendor_sub = p.add_subparsers(dest="vendor_verb", required=True, metavar="ACTION")
    pull = vendor_sub.add_parser("pull", help="extract the vendor roots into a rootfs folder for apply/diff/verify")
    pull.add_argument("recipe", help="the recipe YAML")
    pull.add_argument("-o", "--output", required=True, metavar="DIR", help="the rootfs folder to create")
    pull.add_argument("--image", metavar="TAG", help="pull from this image instead of the recipe's base image")
    pull.add_argument("--json", action="store_true", help="print the report as JSON")
    pull.set_defaults(func=cmd_vendor_pull)

    p = sub.add_parser("verify", help="check a vendor tree (RECIPE --rootfs DIR) or a submission repository "
                       "(OUTDIR): markers, post-states, line endings, linters, run config, payload")
    tree_args(p, reference=False)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("lint", help="catch configurations that cannot start (exit 0 clean, 1 warnings with "
                       "--strict, 2 errors)")
    p.add_argument("recipe", help="the recipe YAML")
    p.add_argument("--variant", metavar="NAME", help="lint one variant (see `toolkit variants`)")
    p.add_argument("--rootfs", metavar="DIR", help="also check against an extracted image (shadowing, remove_when)")
    p.add_argument("--strict", action="store_true", help="exit 1 on warnings")
    p.add_argument("--verbose", action="store_true", help="show info-level notes too")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_lint)

    p = sub.add_parser("variants", help="list the expanded experiment variants with the lint result of each")
    p.add_argument("recipe", help="the recipe YAML")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_variants)

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
