"""Inputs: the recipe's vendor roots under a rootfs folder, declared packages' roots, reference releases fetched
by pip (the one `pip download` helper), their versions, and the cache they are kept in."""

from __future__ import annotations

import ast
import fcntl
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from toolkit.errors import InputError
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


def remember(target: Path, text: str) -> None:
    """A result written into the cache whole: another process reading `target` meanwhile sees the old file or the
    new one, never a part."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(text, encoding="utf-8")
    partial.replace(target)


COMPLETE = ".complete"  # written last into a cached folder: a folder without it is never used


def cached_tree(target: Path, build: Callable[[Path, Path], None]) -> Path:
    """A cache folder built once and atomically: build(tree, scratch) fills `tree` (scratch is thrown away).

    Builds of one folder are serialised by a lock file beside it: two processes that both found it missing (two
    test workers, two CI jobs on one cache) would otherwise both build it and the second rename would replace the
    folder while the first one's caller reads it."""
    if (target / COMPLETE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        try:  # released when the file closes, also when this process dies
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process that is building {target}", file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / COMPLETE).exists():  # built by whoever held the lock before us
            return target
        if target.exists():
            raise InputError(f"cache folder {target} exists but has no {COMPLETE} marker: this tool did not finish "
                             "writing it, so it is left as it is",
                             hint=f"remove {target} (or point TOOLKIT_CACHE_DIR elsewhere) and run again")
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
            tree, scratch = Path(tmp) / "tree", Path(tmp) / "scratch"
            scratch.mkdir()
            build(tree, scratch)
            tree.mkdir(exist_ok=True)
            (tree / COMPLETE).write_text("ok\n")
            tree.rename(target)
    return target


def rootfs_roots(recipe: Recipe, rootfs: Path) -> list[Root]:
    """Every declared vendor root under rootfs; all of them must exist."""
    if not rootfs.is_dir():
        raise InputError(f"--rootfs {rootfs} is not a folder",
                          hint="pass the folder laid out like the image (/ inside it)")
    roots = [Root(r, rootfs / r.lstrip("/")) for r in recipe.vendor.roots]
    missing = [r.label for r in roots if not (r.path / recipe.vendor.package).is_dir()]
    if missing:
        raise InputError(
            f"vendor root(s) without a {recipe.vendor.package}/ package under {rootfs}: {', '.join(missing)}",
            hint="extract the image with `toolkit vendor pull` or fix vendor.roots in the recipe",
        )
    return roots


def parse_package_roots(items: list[str]) -> dict[str, str]:
    """--package-root NAME=DIR, as given on a command line."""
    given: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise InputError(f"--package-root {item!r}: expected NAME=DIR", hint="e.g. --package-root "
                              "transformers=./rootfs/usr/local/lib/python3.10/site-packages")
        given[name] = path
    return given


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
        raise InputError(f"package {name}: no roots here (packages[].roots is empty and no --package-root)",
                          hint=f"pass --package-root {name}=DIR, the site-packages folder that holds {name}/")
    missing = [r.label for r in roots if not (r.path / name).is_dir()]
    if missing:
        raise InputError(f"package {name}: no {name}/ folder in {', '.join(missing)}",
                          hint=f"--package-root {name}=DIR names the folder that holds {name}/, not {name}/ itself")
    return roots


def _literal_version(path: Path, depth: int = 0) -> str | None:
    """The version a Python file sets at module level: `__version__ = "..."`, or what its `from ._version import
    __version__` reads. Read with ast, never imported; a fallback assigned in an `except` branch (vLLM's "dev")
    and anything that is not a version are not taken."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return None
    statements = list(tree.body)
    while statements:
        node = statements.pop(0)
        if isinstance(node, ast.Try):
            statements[:0] = node.body  # the body, not the handlers
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
              and isinstance(node.value.value, str)
              and any(isinstance(t, ast.Name) and t.id in ("__version__", "version") for t in node.targets)):
            try:
                return str(Version(node.value.value))
            except InvalidVersion:
                return None
        elif (isinstance(node, ast.ImportFrom) and node.level == 1 and node.module and depth < 2
              and any(a.name == "__version__" for a in node.names)):
            found = _literal_version(path.with_name(f"{node.module}.py"), depth + 1)
            if found is not None:
                return found
    return None


def version_with_source(root: Path, package: str) -> tuple[str | None, str]:
    """The installed version and where it was read: distribution metadata, else the package's version module.

    Vendor trees are often copies without `*.dist-info`; the package's own `version.py` (or the `_version.py`
    it imports from) still says what it is. Nothing is imported.
    """
    norm = package.replace("-", "_")
    for info in sorted(root.glob(f"{norm}-*.dist-info")) + sorted(root.glob(f"{norm}-*.egg-info")):
        dist = metadata.PathDistribution(info)
        name = dist.metadata["Name"] if dist.metadata is not None else None
        # the folder's name already says the package; a Name that says another one is not it
        if (not name or canonicalize_name(name) == canonicalize_name(package)) and dist.version:
            return dist.version, f"{info.relative_to(root)}/{'METADATA' if info.suffix == '.dist-info' else 'PKG-INFO'}"
    for rel in (f"{norm}/version.py", f"{norm}/_version.py", f"{norm}/__init__.py"):
        version = _literal_version(root / rel)
        if version is not None:
            return version, rel
    return None, f"neither {norm}-*.dist-info/METADATA nor __version__ in {norm}/version.py"


def pip_download(specs: list[str], dest: Path, *, python: str | None = None, platforms: list[str] | None = None,
                 implementation: str | None = None) -> list[Path]:
    """Wheels of `specs`, without their dependencies, into dest (binary only; for another Python and platform when
    given): the one place the toolkit calls `pip download`. Returns the wheels pip wrote."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--progress-bar", "off",
           "--disable-pip-version-check", "-d", str(dest)]
    if python is not None:
        cmd += ["--python-version", python]
    if implementation is not None:
        cmd += ["--implementation", implementation]
    for platform in platforms or []:
        cmd += ["--platform", platform]
    before = set(dest.glob("*.whl"))
    proc = subprocess.run([*cmd, *specs], capture_output=True, text=True)
    if proc.returncode != 0:
        raise InputError(
            f"pip could not download {', '.join(specs)}: {last_line(proc.stderr) or f'exit {proc.returncode}'}",
            hint="check the package index is reachable and the version exists (`pip index versions NAME`)",
        )
    return sorted(set(dest.glob("*.whl")) - before)


def fetch_reference(spec: str, python: str = "3.10", platform: str = "manylinux1_x86_64") -> Path:
    """Download a release wheel with pip (cached) and unpack its Python files; returns the tree."""
    name, _, version = spec.partition("==")
    target = cache_dir() / "reference" / f"{name}-{version}-py{python}-{platform}"

    def build(tree: Path, scratch: Path) -> None:
        print(f"fetching {spec} (python {python}, {platform}) with pip; cached in {target}", file=sys.stderr)
        pip_download([spec], scratch, python=python, platforms=[platform])
        wheels = list(scratch.glob("*.whl"))
        if len(wheels) != 1:
            raise InputError(f"expected one wheel for {spec}, pip gave {[w.name for w in wheels]}")
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
