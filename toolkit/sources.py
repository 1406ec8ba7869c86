"""Vendor trees: the recipe's roots under a rootfs folder, or a reference release fetched by pip."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import git

from toolkit.errors import SourceError
from toolkit.recipe import Deploy, Recipe, Source


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


def package_roots(recipe: Recipe, name: str, rootfs: Path | None, given: dict[str, str]) -> list[Root]:
    """Where a declared package's roots are on this machine: --package-root NAME=DIR, else its declared roots
    under the rootfs. (In the image the in-image step finds it with importlib.util.find_spec instead.)"""
    package = recipe.package(name)
    assert package is not None
    if name in given:
        path = Path(given[name])
        roots = [Root(str(path), path)]
    elif rootfs is not None and package.roots:
        roots = [Root(r, rootfs / r.lstrip("/")) for r in package.roots]
    else:
        raise SourceError(f"package {name}: no roots here (packages[].roots is empty and no --package-root)",
                          hint=f"pass --package-root {name}=DIR, the site-packages folder that holds {name}/")
    missing = [r.label for r in roots if not (r.path / name).is_dir()]
    if missing:
        raise SourceError(f"package {name}: no {name}/ folder in {', '.join(missing)}",
                          hint=f"--package-root {name}=DIR names the folder that holds {name}/, not {name}/ itself")
    return roots


def _literal_version(path: Path) -> str | None:
    """A module-level `__version__ = "..."` in a Python file (read with ast, never imported)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
                and any(isinstance(t, ast.Name) and t.id in ("__version__", "version") for t in node.targets)):
            return node.value.value
    return None


def version_with_source(root: Path, package: str) -> tuple[str | None, str]:
    """The installed version and where it was read: distribution metadata, else the package's version module.

    Vendor trees are often copies without `*.dist-info`; the package's own `version.py` (or the `_version.py`
    it imports from) still says what it is. Nothing is imported.
    """
    norm = package.replace("-", "_")
    candidates = sorted(root.glob(f"{norm}-*.dist-info/METADATA")) + sorted(root.glob(f"{norm}-*.egg-info/PKG-INFO"))
    for meta in candidates:
        for line in meta.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip(), str(meta.relative_to(root))
            if not line.strip():
                break
    for rel in (f"{norm}/version.py", f"{norm}/_version.py", f"{norm}/__init__.py"):
        version = _literal_version(root / rel)
        if version is not None:
            return version, rel
    return None, f"neither {norm}-*.dist-info/METADATA nor __version__ in {norm}/version.py"


def vendor_version(root: Path, package: str) -> str | None:
    return version_with_source(root, package)[0]


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


SOURCE_INFO = ".toolkit-source.json"  # beside the exported files: what was exported, from where, with digests


def used_paths(recipe: Recipe, name: str) -> list[str]:
    """The paths (files or folders, relative to the source's subdir) the recipe's transforms take from a source."""
    return sorted({t.tree_path for t in recipe.transforms if isinstance(t, Deploy) and t.tree == name})


def _blobs(tree: git.Tree, rel: str) -> dict[str, git.Blob]:
    try:
        obj = tree / rel
    except KeyError:
        return {}
    if isinstance(obj, git.Blob):
        return {rel: obj}
    top = str(obj.path)
    return {f"{rel}/{str(b.path)[len(top) + 1:]}": b for b in obj.traverse()
            if isinstance(b, git.Blob) and b.mode != 0o120000}


def resolve_commit(name: str, checkout: Path, rev: str) -> str:
    """The full commit a revision names in a local clone (bare and --no-checkout clones work: git reads blobs)."""
    try:
        repo = git.Repo(checkout)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise SourceError(f"source {name}: {checkout} is not a git repository",
                          hint=f"clone the adapter there (a bare clone is enough), or fix --source {name}=PATH"
                          ) from None
    try:
        return str(repo.git.rev_parse("--verify", "--quiet", f"{rev}^{{commit}}"))
    except git.GitCommandError:
        raise SourceError(f"source {name}: commit {rev} is not in {checkout}",
                          hint=f"git -C {checkout} fetch, or correct the pinned commit") from None


def export_source(source: Source, checkout: Path, commit: str, paths: list[str]) -> Path:
    """The files a recipe uses from a pinned commit of a local clone, as a plain tree (cached).

    Blobs are read with git at the commit, so uncommitted edits, the work tree (or its absence) and files the
    recipe does not use never reach a submission. `@name/path` is relative to the source's subdir.
    """
    commit = resolve_commit(source.name, checkout, commit)
    key = hashlib.sha256(json.dumps([source.subdir, paths]).encode()).hexdigest()[:12]
    target = cache_dir() / "sources" / f"{source.name}-{commit}-{key}"

    def build(tree: Path, scratch: Path) -> None:
        top = git.Repo(checkout).commit(commit).tree
        if source.subdir:
            try:
                top = top / source.subdir
            except KeyError:
                raise SourceError(f"source {source.name}: no folder {source.subdir!r} at commit {commit[:12]}",
                                  hint="fix sources[].subdir, or the pinned commit") from None
        digests: dict[str, str] = {}
        for rel in paths:
            blobs = _blobs(top, rel)
            if not blobs:
                where = f"{source.subdir}/{rel}" if source.subdir else rel
                raise SourceError(f"source {source.name}: {where} is not in commit {commit[:12]}",
                                  hint="fix the deploy's @name/path, or the pinned commit")
            for path, blob in blobs.items():
                data = blob.data_stream.read()
                out = tree / path
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(data)
                os.chmod(out, 0o755 if blob.mode & 0o111 else 0o644)
                digests[path] = hashlib.sha256(data.replace(b"\r\n", b"\n")).hexdigest()  # as the lock records
        info = {"name": source.name, "git": source.git, "commit": commit, "subdir": source.subdir,
                "files": dict(sorted(digests.items()))}
        (tree / SOURCE_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")

    return cached_tree(target, build)


def source_info(tree: Path) -> dict[str, object]:
    data = json.loads((tree / SOURCE_INFO).read_text())
    return data if isinstance(data, dict) else {}


def parse_source_override(item: str) -> tuple[str, str, str | None]:
    """NAME=PATH or NAME=PATH@COMMIT (the commit overrides the pin for one run)."""
    name, sep, rest = item.partition("=")
    if not sep or not name or not rest:
        raise SourceError(f"--source {item!r}: expected NAME=PATH or NAME=PATH@COMMIT",
                          hint="e.g. --source qwen36-adapter=../competition")
    path, at, rev = rest.rpartition("@")
    if at and path and re.fullmatch(r"[0-9a-fA-F]{7,40}", rev):
        return name, path, rev.lower()
    return name, rest, None


def resolve_trees(recipe: Recipe, recipe_dir: Path,
                  overrides: dict[str, tuple[str, str | None]]) -> tuple[dict[str, Path], dict[str, str]]:
    """Each declared source with a local clone, its used files exported at the pinned (or overriding) commit.

    Returns the trees and the commits actually exported, by source name.
    """
    unknown = sorted(set(overrides) - {s.name for s in recipe.sources})
    if unknown:
        raise SourceError(f"--source names no declared source: {', '.join(unknown)}",
                          hint=f"declared: {', '.join(s.name for s in recipe.sources) or 'none'}")
    trees: dict[str, Path] = {}
    commits: dict[str, str] = {}
    for source in recipe.sources:
        local, rev = overrides.get(source.name, (source.path, None))
        if local:
            checkout = Path(local) if Path(local).is_absolute() or source.name in overrides else recipe_dir / local
            tree = export_source(source, checkout.resolve(), rev or source.commit, used_paths(recipe, source.name))
            trees[source.name] = tree
            commits[source.name] = str(source_info(tree)["commit"])
    return trees, commits
