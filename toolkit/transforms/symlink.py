"""symlink: create a link; a glob target must resolve to exactly one file beside the link."""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from toolkit.results import State
from toolkit.transforms.base import Context, Kind, TransformBase
from toolkit.transforms.files import FileOp, FilePlan, under


class Symlink(TransformBase):
    """Create a symlink; the target may be a glob, resolved beside the link (exactly `expect` matches)."""

    kind: Literal["symlink"]
    link: str = Field(description="Absolute: in the image filesystem; relative: in every vendor root")
    target: str = Field(description="What the link points to; a glob (*, ?) is resolved in the link's folder")
    expect: int = Field(default=1, ge=1, le=1, description="How many files the glob must match")

    @model_validator(mode="after")
    def _no_package(self) -> Symlink:
        if self.package is not None:
            raise ValueError("a symlink is made in the vendor roots or the image filesystem; drop `package`")
        return self

    @property
    def target_label(self) -> str:
        return self.link

    @property
    def is_glob(self) -> bool:
        return any(ch in self.target for ch in "*?[")


def resolve_in(base: Path, path: Path, limit: int = 40) -> Path:
    """Follow a chain of links as the image would: absolute targets are inside base, not on this host."""
    for _ in range(limit):
        if not path.is_symlink():
            return Path(os.path.normpath(path))
        target = os.readlink(path)
        path = under(base, target) if target.startswith("/") else path.parent / target
    return Path(os.path.normpath(path))


class SymlinkKind:
    def __init__(self, spec: Symlink, ctx: Context) -> None:
        self.spec = spec

    @property
    def rootfs_level(self) -> bool:
        return self.spec.link.startswith("/")

    def _target(self, base: Path, link: Path) -> tuple[str | None, str]:
        """The link target and a note on how a glob was resolved (or None and why not)."""
        folder = link.parent
        if self.spec.is_glob:
            names = sorted(
                p.name for p in folder.iterdir()
                if fnmatch.fnmatch(p.name, self.spec.target) and p.name != link.name
            ) if folder.is_dir() else []
            # a soname chain (libx.so.11 -> libx.so.11.4.1) is one library reached by several names
            files: dict[Path, list[str]] = {}
            for name in names:
                files.setdefault(resolve_in(base, folder / name), []).append(name)
            if len(files) != self.spec.expect:
                shown = "; ".join(" = ".join(group) for group in files.values()) or "nothing"
                return None, (f"glob {self.spec.target!r} in {self._show(base, folder)} matched "
                              f"{len(files)} distinct file(s) ({shown}), expected {self.spec.expect}")
            group = next(iter(files.values()))
            chosen = min(group, key=lambda n: (len(n), n))
            note = f" (the shortest of {', '.join(group)}: one file)" if len(group) > 1 else ""
            return chosen, note
        target = self.spec.target
        resolved = under(base, target) if target.startswith("/") else folder / target
        if not resolved.exists():
            return None, f"link target {target} does not exist ({self._show(base, resolved)})"
        return target, ""

    @staticmethod
    def _show(base: Path, path: Path) -> str:
        try:
            return "/" + path.relative_to(base).as_posix()
        except ValueError:
            return str(path)

    def plan(self, base: Path, owned: dict[str, str]) -> FilePlan:
        link = under(base, self.spec.link)
        target, note = self._target(base, link)
        if link.is_symlink():
            current = os.readlink(link)
            if target is not None and current == target:
                return FilePlan(State.ALREADY_APPLIED, f"{self.spec.link} -> {current}{note}")
            if not link.exists():
                return FilePlan(State.DRIFTED, f"{self.spec.link} is a dangling link to {current}")
            if target is not None and resolve_in(base, link) == resolve_in(base, link.parent / target):
                return FilePlan(State.SUPERSEDED, f"{self.spec.link} already links to {current}, the same file as "
                                f"{target}: this link may be removable")
            # a link to another file is a changed image, never "already done"
            return FilePlan(State.DRIFTED, f"{self.spec.link} already links to {current}, which is not "
                            + (f"{target}{note}" if target is not None else f"what the recipe wants: {note}"))
        if link.exists():
            return FilePlan(State.SUPERSEDED, f"{self.spec.link} already exists as a file: link may be removable")
        if target is None:
            return FilePlan(State.DRIFTED, note)
        return FilePlan(State.WOULD_APPLY, f"{self.spec.link} -> {target}{note}", (FileOp(link, link=target),))


KIND = Kind(Symlink, SymlinkKind)
