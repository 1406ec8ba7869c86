"""Try a recipe's transforms before a submission is written, so that DRIFTED shows here, not in a build log
the platform never shows.

Where: the real vendor roots (`--rootfs DIR`, everything is tried), or by default a CoreX-like image filesystem
laid out from the recipe's `vendor.reference` release with the documented vendor changes (cached). Nothing is
written to either: the engine only plans. Transforms that need a pinned source this machine has no copy of are
not tried here; the in-image step tries them, and the report says so (`incomplete`, the one check of a complete
tree, words it; the verbs that run the served code refuse such a tree through `require_complete`).
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from toolkit import corexlike
from toolkit.corexlike import VENDOR_EDITS, make_rootfs
from toolkit.engine.plan import Engine, run_packages
from toolkit.errors import ToolkitError
from toolkit.inputs import cache_dir, cached_tree, fetch_reference, package_roots, reference_root, rootfs_roots
from toolkit.pyenv import build_key
from toolkit.recipe import LoadedRecipe, Recipe
from toolkit.results import Result, State
from toolkit.transforms.base import ModuleEdit, TransformBase
from toolkit.transforms.deploy import Deploy

PLAIN = "plain"  # marks a cached tree where the documented vendor edits did not apply to the release


@dataclass(frozen=True)
class Trial:
    where: str
    results: tuple[Result, ...]
    untried: tuple[tuple[str, str], ...]  # (transform id, why it was not tried here)
    notes: tuple[str, ...]

    @property
    def drifted(self) -> tuple[Result, ...]:
        return tuple(r for r in self.results if r.state is State.DRIFTED)

    @property
    def ok(self) -> bool:
        return not self.drifted


def reference_rootfs(recipe: Recipe) -> tuple[Path, bool]:
    """The CoreX-like image filesystem of the recipe's reference release (cached) and whether it is CoreX-like."""
    base = recipe.base_image
    spec = recipe.vendor.reference
    # the layout's builder is part of the key: a change to corexlike.py lays the tree out again
    key = build_key(spec, base.python, base.platform, recipe.vendor.roots, VENDOR_EDITS,
                    files=[Path(corexlike.__file__)])
    target = cache_dir() / "trial" / f"{recipe.vendor.reference_name}-{recipe.vendor.reference_version}-{key}"

    def build(tree: Path, scratch: Path) -> None:
        print(f"laying out a CoreX-like tree of {spec} to try the transforms on; cached in {target}",
              file=sys.stderr)
        reference = fetch_reference(spec, base.python, base.platform)
        roots = tuple(recipe.vendor.roots)
        try:
            make_rootfs(reference, tree, roots=roots)
        except AssertionError:
            # the documented CoreX edits are written against 0.6.3: another release is tried as it is
            shutil.rmtree(tree)
            make_rootfs(reference, tree, corex=False, roots=roots)
            (tree / PLAIN).write_text("the documented vendor edits do not apply to this release\n")

    tree = cached_tree(target, build)
    return tree, not (tree / PLAIN).exists()


def untried_here(recipe: Recipe, pinned: dict[str, Path]) -> dict[str, str]:
    """Transforms that need a pinned source with no local copy: deploys from it, edits of what they deploy, and
    transforms that require any of those."""
    out: dict[str, str] = {}
    missing: list[TransformBase] = []
    for t in recipe.transforms:
        if t.pinned is not None and t.pinned not in pinned:
            out[t.id] = f"deploys from source {t.pinned}, which the image build fetches"
            missing.append(t)
    for t in recipe.transforms:
        if isinstance(t, ModuleEdit):
            for d in missing:
                if isinstance(d, Deploy) and d.covers(str(PurePosixPath(t.file))):
                    out[t.id] = f"edits {t.file}, deployed from source {d.pinned}, which the image build fetches"
    changed = True
    while changed:
        changed = False
        for t in recipe.transforms:
            needed = [r for r in t.requires if r in out]
            if t.id not in out and needed:
                out[t.id] = f"requires {needed[0]}, which is not applied here ({out[needed[0]]})"
                changed = True
    return out


def lacking_sources(recipe: Recipe, untried: dict[str, str]) -> set[str]:
    """The sources whose missing files leave the `untried` transforms out."""
    return {t.pinned for t in recipe.transforms if t.id in untried and t.pinned is not None}


def incomplete(recipe: Recipe, pinned: dict[str, Path]) -> tuple[str, str] | None:
    """What a tree built here would lack (None: nothing): the transforms that need a source with no local files,
    named, and the fix. The one check of a complete tree; every verb that runs the served code makes it first."""
    untried = untried_here(recipe, pinned)
    if not untried:
        return None
    names = sorted(lacking_sources(recipe, untried))
    said = (f"{len(untried)} transform(s) need source(s) {', '.join(names)}, which have no local files here: each "
            f"deploys from it, edits what it deploys, or requires one that does ({_first_ids(list(untried))})")
    fix = " ".join(f"pass --source {s.name}=PATH (a clone of {s.git} at {s.commit[:12]}; a bare one is enough)"
                   for s in recipe.sources if s.name in names)
    return said, fix


def _first_ids(ids: list[str]) -> str:
    return ", ".join(ids[:8]) + (f" and {len(ids) - 8} more" if len(ids) > 8 else "")


def require_complete(loaded: LoadedRecipe, pinned: dict[str, Path], verb: str) -> None:
    """Refuse, before anything is built or started, a run of the served code on a tree without every transform:
    it would run another submission's code (a flag a missing transform adds is unknown, a deployed module absent)."""
    lacking = incomplete(loaded.recipe, pinned)
    if lacking is not None:
        said, fix = lacking
        raise ToolkitError(f"{verb}: the tree would not be the submission's: {said}; nothing was built or started",
                           hint=fix)


def require_applied(loaded: LoadedRecipe, pinned: dict[str, Path], rootfs: Path, verb: str, fix: str) -> None:
    """Refuse, before anything is started, a run on vendor roots the recipe is not applied to (the first root is
    verified as `toolkit verify` does): the code there is not the submission's. fix: what the verb's user does."""
    from toolkit.engine.verify import verify_tree

    try:
        report = verify_tree(loaded, rootfs_roots(loaded.recipe, rootfs)[:1], rootfs, pinned)
    except ToolkitError as exc:
        raise ToolkitError(f"{verb}: --rootfs {rootfs}: cannot check that the recipe is applied there: {exc.message}",
                           hint=exc.hint or "pass --source NAME=PATH") from None
    missing = sorted({r.transform for r in report.results if r.state in (State.WOULD_APPLY, State.DRIFTED)})
    if missing:
        raise ToolkitError(
            f"{verb}: --rootfs {rootfs}: the recipe is not applied there: {len(missing)} transform(s) not in place "
            f"({_first_ids(missing)}); nothing was started", hint=fix)
    changed = sorted({f"{f.root}/{f.file}" for f in report.findings if f.check == "changed-after-apply"})
    if changed:
        raise ToolkitError(
            f"{verb}: --rootfs {rootfs}: {len(changed)} file(s) changed after the recipe was applied there "
            f"({_first_ids(changed)}): the code there is not the submission's; nothing was started", hint=fix)


def try_recipe(loaded: LoadedRecipe, pinned: dict[str, Path], rootfs: Path | None = None,
               given: dict[str, str] | None = None) -> Trial:
    """given: --package-root NAME=DIR, where a declared package is under the rootfs."""
    recipe = loaded.recipe
    untried = untried_here(recipe, pinned)
    no_roots: dict[str, str] = {}  # transforms of a declared package with nothing to try them on
    notes: list[str] = []
    if rootfs is not None:
        base, where, exact = rootfs, f"the vendor roots under {rootfs}", True
    else:
        base, corex_like = reference_rootfs(recipe)
        where = (f"a CoreX-like tree of {recipe.vendor.reference}" if corex_like
                 else f"the plain {recipe.vendor.reference} (the documented CoreX edits do not apply to it)")
        exact = False
    # off the real image the version is the reference's, so vendor.version is not checked there; nor are the
    # replaced vendor files the real image's
    engines = [Engine(loaded, rootfs_roots(recipe, base), base, check_version=exact, pinned=pinned,
                      skip=frozenset(untried), check_replaced=exact)]
    for package in recipe.packages:
        if not recipe.for_package(package.name):
            continue
        if rootfs is not None and (package.roots or package.name in (given or {})):
            roots = package_roots(recipe, package.name, rootfs, given or {})
        elif package.trial_release:
            roots = [reference_root(package.trial_release, recipe.base_image.python, recipe.base_image.platform)]
        else:
            for t in recipe.for_package(package.name):
                no_roots[t.id] = f"edits package {package.name}, which has no roots here and no release to try on"
            untried.update(no_roots)
            continue
        engines.append(Engine(loaded, roots, base, pinned=pinned, skip=frozenset(untried), package=package.name))
    plan = run_packages(engines)
    contracts = [t.id for t in recipe.transforms if isinstance(t, Deploy) and t.replaces and t.id not in untried]
    if contracts and not exact:
        notes.append(f"replacement contracts not checked on the reference ({len(contracts)}: {', '.join(contracts)}):"
                     " its files are not the real image's; the in-image step checks them, and so does "
                     "`toolkit build --rootfs DIR` on an extracted image")
    superseded = sorted({r.transform for r in plan.results if r.state is State.SUPERSEDED})
    if superseded and not exact:
        notes.append(f"SUPERSEDED on the reference: {', '.join(superseded)}: expected for fixes of vendor-only "
                     "changes the reference lacks; they apply on the real image")
    elif superseded:
        notes.append(f"SUPERSEDED on {where}: {', '.join(superseded)}: the patch may be removable")
    lacking = incomplete(recipe, pinned)
    if lacking is not None:
        said, fix = lacking
        notes.append(f"not tried here, tried by the in-image step instead (the recipe's sources[].fetch leaves the "
                     f"source to the image build): {said}; to try them here, {fix}")
    notes.extend(f"not tried here, tried by the in-image step instead: {tid}: {why}" for tid, why in no_roots.items())
    return Trial(where, tuple(plan.results), tuple(sorted(untried.items())), tuple(notes))
