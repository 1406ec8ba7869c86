"""Vendor trees: the recipe's roots under a rootfs folder, or a reference release fetched by pip."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import SourceError
from toolkit.recipe import Recipe


@dataclass(frozen=True)
class Root:
    label: str  # the path inside the image, or "reference:<spec>"
    path: Path  # where it is on this machine


def cache_dir() -> Path:
    base = os.environ.get("TOOLKIT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm-toolkit"
    )
    return Path(base)


COMPLETE = ".complete"  # written last into a cached folder: a folder without it is never used


def cached_tree(target: Path, build: Callable[[Path, Path], None]) -> Path:
    """A cache folder built once and atomically: build(tree, scratch) fills `tree` (scratch is thrown away)."""
    if (target / COMPLETE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        tree, scratch = Path(tmp) / "tree", Path(tmp) / "scratch"
        scratch.mkdir()
        build(tree, scratch)
        tree.mkdir(exist_ok=True)
        (tree / COMPLETE).write_text("ok\n")
        if target.exists():
            shutil.rmtree(target)
        tree.rename(target)
    return target


def rootfs_roots(recipe: Recipe, rootfs: Path) -> list[Root]:
    """Every declared vendor root under rootfs; all of them must exist."""
    if not rootfs.is_dir():
        raise SourceError(f"--rootfs {rootfs} is not a folder",
                          hint="pass the folder laid out like the image (/ inside it)")
    roots = [Root(r, rootfs / r.lstrip("/")) for r in recipe.vendor.roots]
    missing = [r.label for r in roots if not (r.path / recipe.vendor.package).is_dir()]
    if missing:
        raise SourceError(
            f"vendor root(s) without a {recipe.vendor.package}/ package under {rootfs}: {', '.join(missing)}",
            hint="extract the image with `toolkit vendor pull` or fix vendor.roots in the recipe",
        )
    return roots


def vendor_version(root: Path, package: str) -> str | None:
    """The installed version, read from the distribution metadata (no import)."""
    norm = package.replace("-", "_")
    candidates = sorted(root.glob(f"{norm}-*.dist-info/METADATA")) + sorted(root.glob(f"{norm}-*.egg-info/PKG-INFO"))
    for meta in candidates:
        for line in meta.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
            if not line.strip():
                break
    return None


def fetch_reference(spec: str, python: str = "3.10", platform: str = "manylinux1_x86_64") -> Path:
    """Download a release wheel with pip (cached) and unpack its Python files; returns the tree."""
    name, _, version = spec.partition("==")
    target = cache_dir() / "reference" / f"{name}-{version}-py{python}-{platform}"

    def build(tree: Path, scratch: Path) -> None:
        print(f"fetching {spec} (python {python}, {platform}) with pip; cached in {target}", file=sys.stderr)
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
            "--python-version", python, "--platform", platform, "--progress-bar", "off",
            "--disable-pip-version-check", spec, "-d", str(scratch),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SourceError(
                f"pip could not download {spec}: {last_line(proc.stderr) or f'exit {proc.returncode}'}",
                hint="check the package index is reachable and the version exists (`pip index versions NAME`)",
            )
        wheels = list(scratch.glob("*.whl"))
        if len(wheels) != 1:
            raise SourceError(f"expected one wheel for {spec}, pip gave {[w.name for w in wheels]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            # native libraries are large and never patched; the Python files and metadata are what we need
            members = [m for m in wheel.namelist() if not m.endswith((".so", ".a"))]
            wheel.extractall(tree, members)

    return cached_tree(target, build)


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def reference_root(spec: str, python: str, platform: str) -> Root:
    return Root(f"reference:{spec}", fetch_reference(spec, python, platform))


def export_commit(name: str, checkout: Path, commit: str) -> Path:
    """The pinned commit of a local checkout as a plain tree (cached): what the submission bundles.

    Taken with `git archive`, so uncommitted edits in the checkout never leak into an image.
    """
    target = cache_dir() / "sources" / f"{name}-{commit}"
    if (target / COMPLETE).exists():
        return target
    if not (checkout / ".git").exists() and not checkout.joinpath("HEAD").exists():
        raise SourceError(f"source {name}: {checkout} is not a git checkout",
                          hint=f"clone the adapter there, or fix sources[].path / --source {name}=PATH")
    probe = subprocess.run(["git", "-C", str(checkout), "cat-file", "-e", f"{commit}^{{commit}}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        raise SourceError(f"source {name}: commit {commit} is not in {checkout}",
                          hint=f"git -C {checkout} fetch, or correct the pinned commit in the recipe")

    def build(tree: Path, scratch: Path) -> None:
        archive = subprocess.run(["git", "-C", str(checkout), "archive", "--format=tar", commit],
                                 capture_output=True, check=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(tree, filter="tar")

    return cached_tree(target, build)


def resolve_trees(recipe: Recipe, recipe_dir: Path, overrides: dict[str, str]) -> dict[str, Path]:
    """Each declared source that is available locally, exported at its pinned commit."""
    unknown = sorted(set(overrides) - {s.name for s in recipe.sources})
    if unknown:
        raise SourceError(f"--source names no declared source: {', '.join(unknown)}",
                          hint=f"declared: {', '.join(s.name for s in recipe.sources) or 'none'}")
    trees = {}
    for source in recipe.sources:
        local = overrides.get(source.name) or source.path
        if local:
            checkout = Path(local) if Path(local).is_absolute() or source.name in overrides else recipe_dir / local
            trees[source.name] = export_commit(source.name, checkout.resolve(), source.commit)
    return trees
