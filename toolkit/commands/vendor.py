"""vendor pull and vendor compare: the image's vendor roots, and the public release they are built on."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import ToolkitError
from toolkit.inputs import rootfs_roots
from toolkit.recipe import load_recipe
from toolkit.results import Report


def pull(recipe: Path, output: Path, image: str | None = None) -> Report:
    """Extract the recipe's vendor roots from its base image (or `image`) into a new rootfs folder."""
    from toolkit.submission.image import vendor_pull

    loaded = load_recipe(recipe)
    if output.exists() and any(output.iterdir()):
        raise ToolkitError(f"{output} is not empty", hint="pull into a new folder")
    roots = vendor_pull(loaded, output, image)
    return Report("vendor pull", str(loaded.path), notes=(f"{len(roots)} root(s) extracted into {output}: "
                                                          + ", ".join(roots),), extra={"roots": roots})


@dataclass(frozen=True)
class CompareRequest:
    recipe: Path
    rootfs: Path | None = None  # a folder laid out like the image (its first vendor root is compared)
    root: Path | None = None  # or a folder holding the vendor package, or the package folder itself
    candidates: tuple[str, ...] = ()  # NAME==VERSION releases (default: the reference and its neighbours)
    top: int = 12  # differing files listed in the notes (all are in extra)


def compare(request: CompareRequest) -> Report:
    from toolkit.compare import compare as compare_trees
    from toolkit.compare import neighbours, package_dir, report_of
    from toolkit.pyenv import importable
    from toolkit.runtime.env import built

    loaded = load_recipe(request.recipe)
    recipe = loaded.recipe
    if (request.rootfs is None) == (request.root is None):
        raise ToolkitError("give the vendor tree as --rootfs DIR or as --root DIR",
                           hint="--rootfs: a folder laid out like the image (what `toolkit vendor pull` wrote); "
                           f"--root: a folder holding {recipe.vendor.package}/, or {recipe.vendor.package}/ itself")
    root = rootfs_roots(recipe, request.rootfs)[0].path if request.rootfs is not None else request.root
    assert root is not None
    vendor = package_dir(root, recipe.vendor.package)
    specs = list(request.candidates) or neighbours(recipe.vendor.reference)
    result = compare_trees(vendor, recipe.vendor.package, specs, recipe.base_image.python,
                           recipe.base_image.platform, guessed=not request.candidates)
    python = built()  # tells the vendor's libraries from packages the runtime has, when it is built
    installed = {m for m, ok in importable(python, result.vendor_libraries()).items() if ok} if python else None
    return report_of(loaded, result, installed, request.top)
