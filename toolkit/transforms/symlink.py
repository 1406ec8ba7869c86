"""symlink: create a link; a glob target must resolve to exactly one file beside the link."""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

from toolkit.recipe import Symlink
from toolkit.results import State
from toolkit.transforms.base import Context
from toolkit.transforms.files import FileOp, FilePlan, under


class SymlinkKind:
    def __init__(self, spec: Symlink, ctx: Context) -> None:
        self.spec = spec

    @property
    def rootfs_level(self) -> bool:
        return self.spec.link.startswith("/")

    def _target(self, base: Path, link: Path) -> tuple[str | None, str]:
        folder = link.parent
        if self.spec.is_glob:
            names = sorted(
                p.name for p in folder.iterdir()
                if fnmatch.fnmatch(p.name, self.spec.target) and p.name != link.name
            ) if folder.is_dir() else []
            if len(names) != self.spec.expect:
                return None, (f"glob {self.spec.target!r} in {self._show(base, folder)} matched "
                              f"{len(names)} file(s) {names}, expected {self.spec.expect}")
            return names[0], ""
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
        if link.is_symlink():
            current = os.readlink(link)
            target, why = self._target(base, link)
            if target is not None and current == target:
                return FilePlan(State.ALREADY_APPLIED, f"{self.spec.link} -> {current}")
            if link.exists():
                return FilePlan(State.SUPERSEDED, f"{self.spec.link} already links to {current}: link may be removable")
            return FilePlan(State.DRIFTED, f"{self.spec.link} is a dangling link to {current}")
        if link.exists():
            return FilePlan(State.SUPERSEDED, f"{self.spec.link} already exists as a file: link may be removable")
        target, why = self._target(base, link)
        if target is None:
            return FilePlan(State.DRIFTED, why)
        return FilePlan(State.APPLIED, f"{self.spec.link} -> {target}", (FileOp(link, link=target),))
