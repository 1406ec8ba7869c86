"""The in-image step: `python3 -m toolkit.submission.inimage RECIPE` inside the Docker build.

The platform gives no build log, only a status, so this prints one `[ok]` or `[FAIL]` line per
transform and root and a summary, and exits non-zero on anything short of a fully patched image.
It runs offline, with the same engine as `toolkit apply`, and imports no GPU code (the vendor
package is located with importlib.util.find_spec, which does not execute it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from toolkit.engine.plan import Engine, run_packages
from toolkit.engine.verify import verify_tree
from toolkit.engine.writer import commit
from toolkit.errors import ToolkitError
from toolkit.inputs import Root, package_roots, parse_package_roots, version_with_source
from toolkit.recipe import LoadedRecipe, Package, load_recipe
from toolkit.results import Result, State
from toolkit.startup import startup_checks
from toolkit.transforms.base import ModuleEdit
from toolkit.transforms.deploy import lf_digest

FIND_SPEC = ("import importlib.util, sys; spec = importlib.util.find_spec(sys.argv[1]); "
             "print(spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else '')")


def say(ok: bool, text: str) -> None:
    print(f"[{'ok' if ok else 'FAIL'}] {text}", flush=True)


def bundled_pinned(loaded: LoadedRecipe) -> dict[str, Path]:
    """The declared sources the payload holds (bundled by the build, or fetched by apply.sh), by name."""
    folder = loaded.path.parent.parent / "sources"
    return {s.name: folder / s.name for s in loaded.recipe.sources if (folder / s.name).is_dir()}


def payload_pinned(loaded: LoadedRecipe) -> dict[str, Path] | None:
    """Declared sources as the payload holds them (bundled by `toolkit build` or fetched by apply.sh), each file
    checked against the digests the build recorded (bundled) or the recipe's lock gave (fetched)."""
    folder = loaded.path.parent.parent / "sources"
    pinned = bundled_pinned(loaded)
    for name, path in pinned.items():
        lock = folder / f"{name}.digests.json"
        if not lock.is_file():
            print(f"[info] source {name}: {path} (no digests recorded: the pinned commit is what was checked)",
                  flush=True)
            continue
        digests = json.loads(lock.read_text(encoding="utf-8"))
        bad = [rel for rel, digest in sorted(digests.items())
               if not (path / rel).is_file() or lf_digest((path / rel).read_bytes()) != digest]
        if bad:
            say(False, f"source {name}: {len(bad)} file(s) differ from the recorded sha256: {', '.join(bad[:5])}")
            return None
        say(True, f"source {name}: {len(digests)} used file(s) match their recorded sha256 (text LF-normalised, "
            "binaries as they are)")
    return pinned


def existing_roots(loaded: LoadedRecipe, rootfs: Path) -> list[Root]:
    roots = []
    for label in loaded.recipe.vendor.roots:
        path = rootfs / label.lstrip("/")
        if (path / loaded.recipe.vendor.package).is_dir():
            roots.append(Root(label, path))
        else:
            print(f"[info] vendor root {label} is absent from this image; the others are patched", flush=True)
    return roots


def expected_results(loaded: LoadedRecipe, roots: dict[str, int]) -> int:
    """One result per transform and root of its package; image-level deploys and links report once."""
    recipe = loaded.recipe
    return sum(1 if not isinstance(t, ModuleEdit) and t.target_label.startswith("/")
               else roots[recipe.package_of(t)] for t in recipe.transforms)


def locate_package(name: str, workdir: str) -> Path | None:
    """The site-packages folder the server's Python imports `name` from (found without importing it)."""
    location = import_location(name, workdir)
    return Path(location).parent if location else None


def install_offline(loaded: LoadedRecipe, package: Package, wheels: Path) -> bool:
    """Install the package's pinned wheel from the payload, offline and without dependencies."""
    assert package.install is not None
    proc = subprocess.run(["python3", "-m", "pip", "install", "--no-index", "--no-deps", "--disable-pip-version-check",
                           "--find-links", str(wheels), package.install], capture_output=True, text=True,
                          env=server_env())
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        say(False, f"package {package.name}: offline install of {package.install} from {wheels} failed: {tail}")
        return False
    say(True, f"package {package.name}: installed {package.install} from the submission's wheels (offline)")
    return True


def package_roots_in_image(loaded: LoadedRecipe, rootfs: Path, given: dict[str, str]) -> dict[str, list[Root]] | None:
    """Each declared package that transforms edit, at the version the recipe needs (installed if it must be)."""
    recipe = loaded.recipe
    out: dict[str, list[Root]] = {}
    for package in recipe.packages:
        if not recipe.for_package(package.name):
            continue
        for attempt in (1, 2):
            if package.name in given or package.roots:
                try:
                    roots = package_roots(recipe, package.name, rootfs, given)
                except ToolkitError as exc:
                    say(False, str(exc))
                    return None
            elif rootfs == Path("/"):
                found = locate_package(package.name, recipe.serve.workdir)
                roots = [] if found is None else [Root(str(found), found)]
            else:
                say(False, f"package {package.name}: no roots under --rootfs {rootfs}: pass --package-root "
                    f"{package.name}=DIR")
                return None
            version, where = (version_with_source(roots[0].path, package.name) if roots else
                              (None, "not importable"))
            ok = version is not None and Version(version) in SpecifierSet(package.version)
            if ok:
                say(True, f"package {package.name} {version} at {roots[0].label} (read from {where}) satisfies "
                    f"{package.version}")
                out[package.name] = roots
                break
            shown = f"{version} at {roots[0].label}" if roots else "not importable"
            if attempt == 2 or package.install is None or rootfs != Path("/"):
                say(False, f"package {package.name}: {shown}, the recipe needs {package.version}"
                    + ("" if package.install else " (no `install` wheel declared)"))
                return None
            print(f"[info] package {package.name}: {shown}; installing {package.install} offline", flush=True)
            if not install_offline(loaded, package, loaded.path.parent.parent / "packages"):
                return None
    return out


def server_env() -> dict[str, str]:
    """The environment the server runs with: its own PYTHONPATH, not the in-image step's."""
    env = dict(os.environ)
    original = env.pop("TOOLKIT_ORIG_PYTHONPATH", None)
    if original is not None:
        env["PYTHONPATH"] = original
        if not original:
            env.pop("PYTHONPATH")
    return env


def import_location(package: str, workdir: str) -> str:
    """Where `import <package>` resolves for the server: its env, its working directory."""
    os.makedirs(workdir, exist_ok=True)
    proc = subprocess.run(["python3", "-c", FIND_SPEC, package], capture_output=True, text=True, env=server_env(),
                          cwd=workdir)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def verify(loaded: LoadedRecipe, roots: list[Root], rootfs: Path, pinned: dict[str, Path],
           package: str | None = None) -> bool:
    report = verify_tree(loaded, roots, rootfs, pinned, package=package)
    kernels = {t.id for t in loaded.recipe.kernels()}
    for r in report.results:
        if r.state.ok:
            # a prebuilt kernel's digests are the only record of which binary the image runs
            said = f": {' '.join(r.message.split())}" if r.transform in kernels else ""
            say(True, f"verify {r.transform} {r.root} {r.state.value}{said}")
        else:
            say(False, f"verify {r.transform} {r.root}: {' '.join(r.message.split())}")
    for f in report.findings:
        say(False, f"verify {f.check} {f.root} {f.file}: {f.message}")
    if report.ok:
        say(True, f"verify: markers and post-states in {len(roots)} root(s), patched files compile")
    return report.ok


def startup(loaded: LoadedRecipe, roots: list[Root]) -> bool:
    """What the server needs at start, read from the patched files of every root."""
    ok = True
    for root in roots:
        for check in startup_checks(root.path, loaded.recipe):
            say(check.ok, f"start {check.name} {root.label}: {check.detail}")
            ok &= check.ok
    return ok


def run(recipe_path: str, rootfs: Path, verify_only: bool = False, given: dict[str, str] | None = None) -> int:
    loaded = load_recipe(recipe_path)
    recipe = loaded.recipe
    print(f"== toolkit in-image step: recipe {recipe.name}, {len(recipe.transforms)} transform(s)", flush=True)
    roots = existing_roots(loaded, rootfs)
    if not roots:
        say(False, f"no vendor root holds {recipe.vendor.package}/: {', '.join(recipe.vendor.roots)}")
        return 1
    pinned = payload_pinned(loaded)
    if pinned is None:
        return 1
    packages = package_roots_in_image(loaded, rootfs, given or {})
    if packages is None:
        return 1

    def verify_all() -> bool:
        results = [verify(loaded, roots, rootfs, pinned)]
        results += [verify(loaded, proots, rootfs, pinned, package=name) for name, proots in packages.items()]
        return all(results) and startup(loaded, roots)

    if verify_only:
        return 0 if verify_all() else 1
    try:
        engines = [Engine(loaded, roots, rootfs, pinned=pinned)]
        engines += [Engine(loaded, proots, rootfs, pinned=pinned, package=name) for name, proots in packages.items()]
        plan = run_packages(engines)
    except ToolkitError as exc:
        say(False, f"input: {exc}")
        return 1

    def show(results: list[Result]) -> None:
        for r in results:
            line = f"{r.transform} {r.root}"
            if r.state is State.DRIFTED:
                at = f"{loaded.path.name}:{r.origin.line}" if r.origin else loaded.path.name
                say(False, f"{line}: {' '.join(r.message.split())} ({at})")
            else:
                say(True, f"{line} {r.state.value}")

    counts = {recipe.vendor.package: len(roots), **{name: len(p) for name, p in packages.items()}}
    expected = expected_results(loaded, counts)
    if len(plan.results) != expected:
        show(plan.results)
        say(False, f"{len(plan.results)} result(s) for {expected} expected transform x root pair(s)")
        return 1
    if not plan.ok:
        show(plan.results)
        print(f"== summary: FAILED, {sum(1 for r in plan.results if r.state is State.DRIFTED)} DRIFTED; "
              "nothing was written", flush=True)
        return 1
    commit(plan.ops)
    results = plan.written()
    show(results)
    print(f"== applied: {len(plan.ops)} path(s) written, stale bytecode of changed modules removed", flush=True)
    if not verify_all():
        print("== summary: FAILED verification after apply", flush=True)
        return 1
    if rootfs == Path("/"):
        location = import_location(recipe.vendor.package, recipe.serve.workdir)
        patched = {str(Path(r.path, recipe.vendor.package).resolve()) for r in roots}
        resolved = str(Path(location).resolve()) if location else ""
        if resolved not in patched:
            say(False, f"`import {recipe.vendor.package}` from {recipe.serve.workdir} resolves to "
                f"{location or 'nothing'}, which is not a patched root")
            return 1
        say(True, f"`import {recipe.vendor.package}` from {recipe.serve.workdir} resolves to {location} (patched)")
    else:
        print(f"[info] import check not run: --rootfs {rootfs} is not / (it only means something in the image)",
              flush=True)
    summary = {s: sum(1 for r in results if r.state is s) for s in State}
    print("== summary: ok, " + ", ".join(f"{n} {s.value}" for s, n in summary.items() if n), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m toolkit.submission.inimage", description=__doc__)
    parser.add_argument("recipe", help="the resolved recipe in the payload")
    parser.add_argument("--rootfs", default="/", type=Path, help="the image filesystem (default /)")
    parser.add_argument("--verify-only", action="store_true", help="check an image that was already patched")
    parser.add_argument("--package-root", action="append", default=[], metavar="NAME=DIR",
                        help="where a declared package is under --rootfs (default: found with find_spec in /)")
    args = parser.parse_args(argv)
    try:
        return run(args.recipe, args.rootfs, args.verify_only, parse_package_roots(args.package_root))
    except ToolkitError as exc:
        say(False, str(exc))
        return 1


if __name__ == "__main__":
    sys.exit(main())
