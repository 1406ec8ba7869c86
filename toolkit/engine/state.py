"""What the engine records in each root (the state file: pristine and patched digests, what it placed, what it
marked) and the lock of a base image's inputs."""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.errors import InputDriftError

STATE_FILE = ".toolkit/state.json"


def read_state(root: Path) -> dict[str, object]:
    path = root / STATE_FILE
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise InputDriftError(f"{path}: unreadable toolkit state ({exc})",
                              hint="remove it only together with a pristine reinstall of the vendor package") from None
    return data if isinstance(data, dict) else {}


def make_lock(pristine: dict[str, str], version: str | None, recipe_name: str, package: str) -> dict[str, object]:
    """The lock of a plan's inputs: the vendor version and the pristine sha256 of every target file."""
    return {"recipe": recipe_name, "vendor": {"package": package, "version": version},
            "files": dict(sorted(pristine.items()))}


def check_lock(lock: dict[str, object], pristine: dict[str, str], version: str | None) -> None:
    """Refuse inputs that differ from the lock, before any transform is planned."""
    vendor = lock.get("vendor", {})
    locked_version = vendor.get("version") if isinstance(vendor, dict) else None
    problems = []
    if locked_version != version:
        problems.append(f"vendor version {version} (locked {locked_version})")
    files = lock.get("files", {})
    files = files if isinstance(files, dict) else {}
    for rel, digest in pristine.items():
        if rel not in files:
            problems.append(f"{rel} is not in the lock")
        elif files[rel] != digest:
            problems.append(f"{rel} sha256 {digest[:12]} (locked {str(files[rel])[:12]})")
    if problems:
        raise InputDriftError("input drift against the lock: " + "; ".join(problems),
                              hint="the base image changed: review the diff, then refresh the lock with --write-lock")
