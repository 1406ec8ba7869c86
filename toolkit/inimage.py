"""The in-image step: `python3 -m toolkit.inimage RECIPE` inside the Docker build.

The platform gives no build log, only a status, so this prints one `[ok]` or `[FAIL]` line per
transform and root and a summary, and exits non-zero on anything short of a fully patched image.
It runs offline, with the same engine as `toolkit apply`, and imports no GPU code (the vendor
package is located with importlib.util.find_spec, which does not execute it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from toolkit.engine import Engine, commit
from toolkit.errors import ToolkitError
from toolkit.recipe import LoadedRecipe, SourceTransform, load_recipe
from toolkit.results import State
from toolkit.sources import Root
from toolkit.verify import verify_tree

FIND_SPEC = ("import importlib.util, sys; spec = importlib.util.find_spec(sys.argv[1]); "
             "print(spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else '')")


def say(ok: bool, text: str) -> None:
    print(f"[{'ok' if ok else 'FAIL'}] {text}", flush=True)


def payload_trees(loaded: LoadedRecipe) -> dict[str, Path]:
    """Declared sources as the payload holds them: bundled by `toolkit build` or fetched by apply.sh."""
    folder = loaded.path.parent.parent / "sources"
    trees = {s.name: folder / s.name for s in loaded.recipe.sources if (folder / s.name).is_dir()}
    for name, path in trees.items():
        print(f"[info] source {name}: {path}", flush=True)
    return trees


def existing_roots(loaded: LoadedRecipe, rootfs: Path) -> list[Root]:
    roots = []
    for label in loaded.recipe.vendor.roots:
        path = rootfs / label.lstrip("/")
        if (path / loaded.recipe.vendor.package).is_dir():
            roots.append(Root(label, path))
        else:
            print(f"[info] vendor root {label} is absent from this image; the others are patched", flush=True)
    return roots


def expected_results(loaded: LoadedRecipe, roots: int) -> int:
    """One result per transform and root; image-level deploys and links report once."""
    return sum(1 if not isinstance(t, SourceTransform) and t.target_label.startswith("/") else roots
               for t in loaded.recipe.transforms)


def import_location(package: str, workdir: str) -> str:
    """Where `import <package>` resolves for the server: its env, its working directory."""
    env = dict(os.environ)
    original = env.pop("TOOLKIT_ORIG_PYTHONPATH", None)
    if original is not None:
        env["PYTHONPATH"] = original
        if not original:
            env.pop("PYTHONPATH")
    os.makedirs(workdir, exist_ok=True)
    proc = subprocess.run(["python3", "-c", FIND_SPEC, package], capture_output=True, text=True, env=env,
                          cwd=workdir)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def verify(loaded: LoadedRecipe, roots: list[Root], rootfs: Path, trees: dict[str, Path]) -> bool:
    report = verify_tree(loaded, roots, rootfs, trees)
    for r in report.results:
        if r.state.ok:
            say(True, f"verify {r.transform} {r.root} {r.state.value}")
        else:
            say(False, f"verify {r.transform} {r.root}: {' '.join(r.message.split())}")
    for f in report.findings:
        say(False, f"verify {f.check} {f.root} {f.file}: {f.message}")
    if report.ok:
        say(True, f"verify: markers and post-states in {len(roots)} root(s), patched files compile")
    return report.ok


def run(recipe_path: str, rootfs: Path, verify_only: bool = False) -> int:
    loaded = load_recipe(recipe_path)
    recipe = loaded.recipe
    print(f"== toolkit in-image step: recipe {recipe.name}, {len(recipe.transforms)} transform(s)", flush=True)
    roots = existing_roots(loaded, rootfs)
    if not roots:
        say(False, f"no vendor root holds {recipe.vendor.package}/: {', '.join(recipe.vendor.roots)}")
        return 1
    trees = payload_trees(loaded)
    if verify_only:
        return 0 if verify(loaded, roots, rootfs, trees) else 1
    try:
        plan = Engine(loaded, roots, rootfs, trees=trees).run()
    except ToolkitError as exc:
        say(False, f"input: {exc}")
        return 1
    for r in plan.results:
        line = f"{r.transform} {r.root}"
        if r.state is State.DRIFTED:
            say(False, f"{line}: {' '.join(r.message.split())} ({loaded.path.name}:{r.recipe_line})")
        else:
            say(True, f"{line} {r.state.value}")
    expected = expected_results(loaded, len(roots))
    if len(plan.results) != expected:
        say(False, f"{len(plan.results)} result(s) for {expected} expected transform x root pair(s)")
        return 1
    if not plan.ok:
        print(f"== summary: FAILED, {sum(1 for r in plan.results if r.state is State.DRIFTED)} DRIFTED; "
              "nothing was written", flush=True)
        return 1
    commit(plan.ops)
    print(f"== applied: {len(plan.ops)} path(s) written, stale bytecode of changed modules removed", flush=True)
    if not verify(loaded, roots, rootfs, trees):
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
    summary = {s: sum(1 for r in plan.results if r.state is s) for s in State}
    print("== summary: ok, " + ", ".join(f"{n} {s.value}" for s, n in summary.items() if n), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m toolkit.inimage", description=__doc__)
    parser.add_argument("recipe", help="the resolved recipe in the payload")
    parser.add_argument("--rootfs", default="/", type=Path, help="the image filesystem (default /)")
    parser.add_argument("--verify-only", action="store_true", help="check an image that was already patched")
    args = parser.parse_args(argv)
    try:
        return run(args.recipe, args.rootfs, args.verify_only)
    except ToolkitError as exc:
        say(False, str(exc))
        return 1


if __name__ == "__main__":
    sys.exit(main())
