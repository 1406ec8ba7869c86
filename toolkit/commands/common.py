"""What several verbs share: the declared sources available here, the vendor and package roots, the engines over
them, JSON inputs, the exit code of a report."""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.engine.plan import Engine
from toolkit.errors import EXIT_FAILED, EXIT_OK, EXIT_SUPERSEDED, ToolkitError
from toolkit.inputs import Root, package_roots, reference_root, rootfs_roots
from toolkit.pinned import parse_source_override, resolve_pinned
from toolkit.recipe import LoadedRecipe
from toolkit.results import Report, State
from toolkit.variants import Variant
from toolkit.variants import expand as expand_variants
from toolkit.variants import find as find_variant


@dataclass(frozen=True)
class Inputs:
    """Where a verb finds what the recipe builds on, besides the recipe itself.

    sources: NAME -> a local clone, `PATH` or `PATH@COMMIT` (the commit overrides the pin for this run);
    package_roots: NAME -> the site-packages folder holding a declared package; expect: a JSON lock whose
    replacement digests replace the recipe's (for trees that are not the real image)."""

    sources: Mapping[str, str] = field(default_factory=dict)
    package_roots: Mapping[str, str] = field(default_factory=dict)
    expect: Path | None = None


def pinned(loaded: LoadedRecipe, given: Inputs, fetch: bool = False) -> tuple[LoadedRecipe, dict[str, Path]]:
    """The declared sources available here (fetch: cloned by this host where the recipe says so, as `build` does),
    and the recipe with any overriding pin and --expect lock applied."""
    overrides: dict[str, tuple[str, str | None]] = {}
    for name, where in given.sources.items():
        _, path, rev = parse_source_override(f"{name}={where}")
        overrides[name] = (path, rev)
    found, commits = resolve_pinned(loaded.recipe, loaded.path.parent, overrides, fetch=fetch)
    loaded = dataclasses.replace(loaded, found=found)
    pins = {s.name: s.commit for s in loaded.recipe.sources}
    moved = {name: sha for name, sha in commits.items() if pins[name] != sha}
    for name, sha in moved.items():
        print(f"source {name}: pin {pins[name][:12]} overridden by --source for this run: {sha}", file=sys.stderr)
    if moved:
        sources = [s.model_copy(update={"commit": moved.get(s.name, s.commit)}) for s in loaded.recipe.sources]
        loaded = dataclasses.replace(loaded, recipe=loaded.recipe.model_copy(update={"sources": sources}))
    if given.expect is not None:
        lock = read_json(given.expect, "an expectations lock", "a JSON object: replaced file (dest) -> sha256 of its "
                         "LF-normalised content, e.g. taken from a test fixture")
        try:
            loaded = dataclasses.replace(loaded, recipe=loaded.recipe.with_expectations(
                {str(k): str(v) for k, v in lock.items()}))
        except ValueError as exc:
            raise ToolkitError(f"--expect {given.expect}: {exc}") from None
        print(f"replacement expectations from {given.expect}, not the recipe: {len(lock)} file(s); the real image's "
              "files are only checked without --expect", file=sys.stderr)
    return loaded, found


def vendor_roots(loaded: LoadedRecipe, rootfs: Path | None,
                 reference: str | bool | None = None) -> tuple[list[Root], Path | None]:
    """The vendor roots: a public release (reference: True for the recipe's), or the recipe's roots under rootfs."""
    if reference:
        spec = loaded.recipe.vendor.reference if reference is True else str(reference)
        base = loaded.recipe.base_image
        return [reference_root(spec, base.python, base.platform)], None
    if rootfs is None:
        raise ToolkitError("no vendor tree given", hint="pass --rootfs DIR (a folder laid out like the image)")
    return rootfs_roots(loaded.recipe, rootfs), rootfs


def declared_package_roots(loaded: LoadedRecipe, given: Mapping[str, str], rootfs: Path | None,
                           reference: str | bool | None = None) -> dict[str, list[Root]]:
    """The roots of every declared package that transforms edit (the vendor's are vendor_roots')."""
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
        if reference and package.name not in given and release:
            out[package.name] = [reference_root(release, recipe.base_image.python, recipe.base_image.platform)]
        else:
            out[package.name] = package_roots(recipe, package.name, rootfs, dict(given))
    return out


def engines(loaded: LoadedRecipe, rootfs: Path | None, given: Inputs, found: dict[str, Path],
            reference: str | bool | None = None, **options: Any) -> tuple[list[Engine], list[Root]]:
    """One engine per package the recipe edits: the vendor's first."""
    roots, base = vendor_roots(loaded, rootfs, reference)
    out = [Engine(loaded, roots, base, pinned=found, **options)]
    for name, package_roots_ in declared_package_roots(loaded, given.package_roots, base, reference).items():
        out.append(Engine(loaded, package_roots_, base, pinned=found, package=name, **options))
    return out, roots


def read_json(path: Path, what: str, hint: str) -> dict[str, object]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ToolkitError(f"{what} {path} not found", hint=hint) from None
    except json.JSONDecodeError as exc:
        raise ToolkitError(f"{path}:{exc.lineno}: {what} is not JSON ({exc.msg})", hint=hint) from None
    if not isinstance(data, dict):
        raise ToolkitError(f"{path}: {what} is a JSON object", hint=hint)
    return data


def finished(report: Report, strict: bool = False) -> Report:
    """The report with the exit code its content calls for (strict: a SUPERSEDED transform exits 4)."""
    if not report.ok:
        code = EXIT_FAILED
    elif strict and report.count(State.SUPERSEDED):
        code = EXIT_SUPERSEDED
    else:
        code = EXIT_OK
    return dataclasses.replace(report, exit_code=code)


def chosen_variants(loaded: LoadedRecipe, variant: str | None, all_variants: bool) -> list[Variant]:
    """One variant by name, else every variant with all_variants, else the base (the first of the expanded set)."""
    if variant:
        return [find_variant(loaded.recipe, variant)]
    every = expand_variants(loaded.recipe)
    return every if all_variants else every[:1]


def run_folder(output: Path | None, prefix: str, what: str) -> Path:
    """Where a verb writes its run: `output` if it is new or an empty folder (made), else a new temporary folder
    (kept); never a folder with something in it, which the run could not prove it wrote."""
    if output is None:
        return Path(tempfile.mkdtemp(prefix=prefix))
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ToolkitError(f"-o {output}: exists and is not an empty folder; {what} writes only into a folder it "
                           "creates (or an empty one)", hint="give a new path")
    output.mkdir(parents=True, exist_ok=True)
    return output
