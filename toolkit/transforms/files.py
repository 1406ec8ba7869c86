"""What the filesystem kinds (deploy, symlink) plan: writes and links, executed by the engine."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.results import State


@dataclass(frozen=True)
class FileOp:
    path: Path
    content: bytes | None = None  # write this file
    link: str | None = None  # or create this symlink
    mode: int = 0o644


@dataclass(frozen=True)
class FilePlan:
    state: State
    message: str
    ops: tuple[FileOp, ...] = ()
    owned: tuple[tuple[str, str], ...] = field(default_factory=tuple)  # (relative path, sha256) we placed


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_binary(data: bytes) -> bool:
    """A NUL byte in the first 8 KiB: not text (never line-ending-normalised or -checked)."""
    return b"\0" in data[:8192]


def under(base: Path, path: str) -> Path:
    """A recipe path inside a tree: absolute paths are taken relative to the tree's top."""
    return base / path.lstrip("/")
