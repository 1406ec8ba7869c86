"""What the flagship resolves to and what its build writes, as digests: the snapshot that proves a change to how the
recipe is written (its split into layers, a group's defaults) changed nothing it builds.

`python tests/flagship_snapshot.py` rewrites tests/data/flagship-snapshot.json from the recipe as it stands; the
test (tests/test_layers.py) compares a fresh snapshot with the committed one and names what differs. Rewrite it only
for a change that is meant to change the submission, and say so in the commit.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SNAPSHOT = REPO / "tests" / "data" / "flagship-snapshot.json"
FLAGSHIP = REPO / "recipes" / "bi100-qwen36.yaml"
# the toolkit's own modules (and the manifest that lists their digests) change with every toolkit change; what the
# snapshot holds is what the recipe decides
UNSNAPPED = ("toolkit_payload/src/", "toolkit_payload/MANIFEST.json", ".git/")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def files_of(folder: Path, skip: tuple[str, ...] = (), unsaid: str = "") -> dict[str, str]:
    """Path -> sha256 (or link target); `unsaid` is replaced by a fixed word first (the adapter repository's commit,
    which changes with the time the test's repository was made)."""
    out: dict[str, str] = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if rel.startswith(skip) or "__pycache__" in path.parts:
            continue
        if path.is_symlink():
            out[rel] = f"link:{path.readlink()}"
        elif path.is_file():
            data = path.read_bytes()
            out[rel] = _sha(data.replace(unsaid.encode(), b"COMMIT") if unsaid else data)
    return out


def recipe_part(recipe_path: Path) -> dict[str, Any]:
    from toolkit.recipe import load_recipe

    loaded = load_recipe(recipe_path)
    data = loaded.recipe.model_dump(mode="json")
    transforms = data.pop("transforms")
    # the folder, not how it is spelled: `../patches/src` from recipes/ and `toolkit:` in a checkout are one folder
    data["patches"] = loaded.patches_dir.relative_to(REPO).as_posix()
    return {
        "transforms": [f"{t['id']} {t['kind']} {_sha(json.dumps(t, sort_keys=True).encode())[:16]}"
                       for t in transforms],
        "sections": {key: _sha(json.dumps(value, sort_keys=True).encode())[:16] for key, value in data.items()},
    }


def snapshot(recipe_path: Path, work: Path, adapter: list[str], package_root: list[str],
             rootfs: Path) -> dict[str, Any]:
    """The recipe's resolved parts, its built submission (--all-variants) and the files `toolkit apply` writes."""
    from toolkit.cli import main

    commit = adapter[-1].rpartition("@")[2]
    out = work / "submission"
    if main(["build", str(recipe_path), "-o", str(out), "--all-variants", *adapter]) != 0:
        raise AssertionError(f"toolkit build {recipe_path} failed")
    pristine = files_of(rootfs)
    if main(["apply", str(recipe_path), "--rootfs", str(rootfs), *adapter, *package_root]) != 0:
        raise AssertionError(f"toolkit apply {recipe_path} failed")
    patched = {rel: digest for rel, digest in files_of(rootfs, unsaid=commit).items() if pristine.get(rel) != digest}
    return {**recipe_part(recipe_path), "build": files_of(out, UNSNAPPED, commit), "patched": patched}


def fixture_inputs(work: Path) -> tuple[list[str], list[str], Path]:
    """The adapter's pinned files (tests/pinned_adapter.py), the CoreX-like rootfs with transformers in it: what the
    suite's fixtures give."""
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import transformers_site
    from pinned_adapter import make_repo

    from toolkit.corexlike import COREX_BASE, make_rootfs
    from toolkit.inputs import fetch_reference

    vllm = fetch_reference(COREX_BASE)
    (work / "adapter").mkdir()
    clone, commit = make_repo(work / "adapter")
    rootfs = make_rootfs(vllm, work / "rootfs")
    site = transformers_site(rootfs, fetch_reference("transformers==4.55.3"))
    return ["--source", f"qwen36-adapter={clone}@{commit}"], ["--package-root", f"transformers={site}"], rootfs


def differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """What differs, by name: a transform moved or changed, a section, a file."""
    out: list[str] = []
    if expected["transforms"] != actual["transforms"]:
        import difflib

        out += [line for line in difflib.unified_diff(expected["transforms"], actual["transforms"], "snapshot",
                                                       "now", lineterm="", n=0)]
    for part in ("sections", "build", "patched"):
        a, b = expected[part], actual[part]
        out += [f"{part}: {key} {'added' if key not in a else 'removed' if key not in b else 'changed'}"
                for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]
    return out


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="flagship-snapshot-") as tmp:
        work = Path(tmp)
        adapter, package_root, rootfs = fixture_inputs(work)
        data = snapshot(FLAGSHIP, work, adapter, package_root, rootfs)
        from pinned_adapter import NEWEST, NEWEST_FILES

        data["adapter"] = f"the pinned files of {NEWEST} ({NEWEST_FILES.name}, checked against its BLOBS.txt)"
        shutil.rmtree(work / "submission")
    SNAPSHOT.parent.mkdir(exist_ok=True)
    SNAPSHOT.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"{SNAPSHOT}: {len(data['transforms'])} transforms, {len(data['build'])} built files, "
          f"{len(data['patched'])} patched files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
