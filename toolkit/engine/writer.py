"""The all-or-nothing writer: every planned write is made, or every byte that was there before is put back."""

from __future__ import annotations

import os
from pathlib import Path

from toolkit.errors import WriteError
from toolkit.transforms.files import FileOp

Snapshot = tuple[str, bytes | str | None, int]


def _snapshot(path: Path) -> Snapshot:
    if path.is_symlink():
        return ("link", os.readlink(path), 0)
    if path.is_file():
        return ("file", path.read_bytes(), path.stat().st_mode & 0o7777)
    return ("none", None, 0)


def _place(path: Path, content: bytes | None, link: str | None, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.toolkit-tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    if link is not None:
        os.symlink(link, tmp)
    elif content is not None:
        tmp.write_bytes(content)
        os.chmod(tmp, mode)
    else:
        if path.is_symlink() or path.exists():
            path.unlink()
        return
    os.replace(tmp, path)


def commit(ops: list[FileOp]) -> None:
    """Write every op, or on any failure put back every byte that was there before."""
    done: list[tuple[Path, Snapshot]] = []
    made_dirs: list[Path] = []
    current = Path()
    try:
        for op in ops:
            current = op.path
            missing = [p for p in [op.path.parent, *op.path.parent.parents] if not p.exists()]
            for folder in reversed(missing):
                folder.mkdir()
                made_dirs.append(folder)
            snap = _snapshot(op.path)
            done.append((op.path, snap))
            _place(op.path, op.content, op.link, op.mode)
    except BaseException as exc:
        _rollback(done, made_dirs)
        if isinstance(exc, OSError):
            raise WriteError(
                f"writing {current} failed ({exc.strerror or exc}); all {len(done)} earlier write(s) were "
                "rolled back, every root is as it was",
                hint="free space or fix permissions, then run apply again",
            ) from exc
        raise


def _rollback(done: list[tuple[Path, Snapshot]], made_dirs: list[Path]) -> None:
    for path, (what, data, mode) in reversed(done):
        if what == "link":
            _place(path, None, str(data), 0)
        elif what == "file":
            _place(path, data if isinstance(data, bytes) else None, None, mode)
        elif path.is_symlink() or path.exists():
            path.unlink()
    for folder in reversed(made_dirs):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
