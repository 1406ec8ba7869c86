"""apply, diff, verify: the recipe's transforms over vendor roots (and a declared package's), all or nothing."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.commands.common import (
    Inputs,
    declared_package_roots,
    engines,
    finished,
    pinned,
    read_json,
    vendor_roots,
)
from toolkit.commands.progress import PROGRESS
from toolkit.engine.plan import run_packages
from toolkit.engine.state import make_lock
from toolkit.engine.verify import verify_tree
from toolkit.engine.writer import commit
from toolkit.lint import lint
from toolkit.recipe import load_recipe
from toolkit.results import Report


@dataclass(frozen=True)
class ApplyRequest:
    recipe: Path
    rootfs: Path | None  # a folder laid out like the image (None is refused, saying so)
    inputs: Inputs = field(default_factory=Inputs)
    dry_run: bool = False
    strict: bool = False  # exit 4 when a transform is SUPERSEDED
    check_lock: Path | None = None  # refuse inputs whose pristine sha256 differ from this lock
    write_lock: Path | None = None  # write the lock (vendor version + pristine sha256)


def apply(request: ApplyRequest) -> Report:
    """Every transform on every root under the rootfs, all or nothing."""
    loaded, found = pinned(load_recipe(request.recipe), request.inputs)
    planned, _ = engines(loaded, request.rootfs, request.inputs, found)
    if request.check_lock is not None:  # the lock records the vendor roots' inputs
        planned[0].lock = read_json(request.check_lock, "lock file", "create it with `toolkit apply --write-lock FILE`")
    plan = run_packages(planned)
    written: list[str] = []
    PROGRESS.untouched = "nothing was written: the writes are all-or-nothing and were rolled back or never began"
    results = plan.results
    if plan.ok and not request.dry_run:
        commit(plan.ops)
        results = plan.written()
        written = [str(op.path) for op in plan.ops]
        PROGRESS.done.append(f"the apply completed: {len(written)} path(s) written in the vendor roots")
    if plan.ok and request.write_lock is not None:
        lock = make_lock(plan.pristine, next(iter(plan.versions.values()), None), loaded.recipe.name,
                         loaded.recipe.vendor.package)
        request.write_lock.write_text(json.dumps(lock, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        PROGRESS.done.append(f"lock written to {request.write_lock}")
    notes = list(plan.notes)
    if not plan.ok:
        notes.append("nothing was written: fix the DRIFTED transforms (or the vendor tree) and run again")
    elif request.dry_run:
        notes.append(f"dry run: {len(plan.ops)} write(s) planned, none made")
    else:
        notes.append(f"{len(written)} path(s) written")
    return finished(Report("apply", str(loaded.path), tuple(results), notes=tuple(notes),
                           extra={"written": written, "dry_run": request.dry_run}), request.strict)


@dataclass(frozen=True)
class DiffRequest:
    recipe: Path
    rootfs: Path | None = None
    reference: str | bool | None = None  # True: the recipe's vendor.reference; a NAME==VERSION: that release
    inputs: Inputs = field(default_factory=Inputs)


def diff(request: DiffRequest) -> Report:
    """What apply would change, one unified diff per transform (in the first root of each package; the others
    hold the same files): extra["diffs"]. Writes nothing."""
    loaded, found = pinned(load_recipe(request.recipe), request.inputs)
    planned, _ = engines(loaded, request.rootfs, request.inputs, found, request.reference,
                         check_version=not request.reference)
    plan = run_packages(planned)
    firsts = {e.roots[0].label for e in planned}
    steps = [s for s in plan.steps if s.root in (*firsts, "/")]
    return finished(Report("diff", str(loaded.path), tuple(plan.results),
                           notes=(f"diff against {planned[0].roots[0].label}; other roots hold identical files",),
                           extra={"diffs": [{"transform": s.transform, "file": s.file, "root": s.root,
                                             "diff": s.unified()} for s in steps]}))


@dataclass(frozen=True)
class VerifyRequest:
    recipe: Path
    rootfs: Path | None  # a folder laid out like the image (None is refused, saying so)
    inputs: Inputs = field(default_factory=Inputs)


def verify(request: VerifyRequest) -> Report:
    """Markers and post-states in every root, files compile, LF-only where the recipe says, and the recipe lints
    without errors (a tree that verifies but whose recipe cannot start is not verified)."""
    loaded, found = pinned(load_recipe(request.recipe), request.inputs)
    roots, rootfs = vendor_roots(loaded, request.rootfs)
    report = verify_tree(loaded, roots, rootfs, found)
    order = {t.id: i for i, t in enumerate(loaded.recipe.transforms)}
    for name, package_roots in declared_package_roots(loaded, request.inputs.package_roots, rootfs).items():
        extra = verify_tree(loaded, package_roots, rootfs, found, package=name)
        merged = sorted((*report.results, *extra.results), key=lambda r: (order[r.transform], r.root))
        report = dataclasses.replace(report, results=tuple(merged), findings=(*report.findings, *extra.findings),
                                     notes=(*report.notes, *extra.notes))
    lint_errors = lint(loaded, rootfs=rootfs).refusals
    return finished(dataclasses.replace(report, issues=lint_errors))
