"""deploy: copy a file or a folder from the patches folder into each vendor root or the image."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from toolkit.errors import ToolkitError
from toolkit.fields import Sha256, relative_path
from toolkit.results import State
from toolkit.transforms.base import Context, Kind, TransformBase
from toolkit.transforms.files import FileOp, FilePlan, is_binary, sha256, under


class Deploy(TransformBase):
    """Copy a file or folder from patches/src into a vendor root (relative dest) or the image (absolute dest)."""

    kind: Literal["deploy"]
    source: str = Field(description="Path relative to the recipe's patches folder")
    dest: str = Field(description="Relative: inside every vendor root; absolute: inside the image filesystem")
    overwrite: bool = Field(default=False, description="Allow replacing a file that exists with other content")
    replaces: Sha256 | None = Field(
        default=None, description="A whole-file replacement as a contract: the sha256 (line endings normalised "
        "to LF) of the vendor file this deploy replaces. Any other file there is DRIFTED and nothing is written; "
        "one file only")
    needs_args: dict[str, str] = Field(
        default_factory=dict, description="Server flags the deployed file needs to work, each with why (flag "
        "without dashes -> why); lint refuses a recipe or variant whose serve.args does not pass one")

    @field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        if value.startswith("@"):
            name, _, rest = value[1:].partition("/")
            if not name or not rest:
                raise ValueError(f"a file of a declared source is written @name/path, got {value!r}")
            relative_path(rest)
            return value
        return relative_path(value)

    @property
    def target_label(self) -> str:
        return self.dest

    @property
    def pinned(self) -> str | None:
        """The declared source this deploy takes its files from, if any."""
        return self.source[1:].partition("/")[0] if self.source.startswith("@") else None

    def patch_paths(self) -> list[str]:
        return [] if self.pinned is not None else [self.source]  # a declared source's files travel on their own

    def covers(self, rel: str) -> bool:
        """Whether what is at `rel` (relative to a root, or absolute in the image) is this deploy's: its file, or a
        file under its folder."""
        dest = self.dest.rstrip("/")
        return rel == dest or rel.startswith(dest + "/")

    @property
    def pinned_path(self) -> str:
        return self.source[1:].partition("/")[2] if self.source.startswith("@") else self.source

    @model_validator(mode="after")
    def _one_replacement(self) -> Deploy:
        if self.replaces is not None and self.overwrite:
            raise ValueError("`replaces` already allows the replacement, and only of that file: drop `overwrite`")
        if self.replaces is not None and self.package is None and self.dest.startswith("/"):
            raise ValueError("`replaces` contracts a vendor file: dest is relative to the package roots")
        return self

    @field_validator("dest")
    @classmethod
    def _dest(cls, value: str) -> str:
        if value.startswith("/"):
            relative_path(value.lstrip("/"))
        else:
            relative_path(value)
        return value


OVERWRITE_HINT = ": set `overwrite: true` if replacing the vendor file is intended"
SKIP_PARTS = {"__pycache__", ".pytest_cache", ".mypy_cache"}


def source_files(source: Path) -> dict[str, Path]:
    """Relative path -> file, for a file or a folder (bytecode caches left out)."""
    if source.is_file():
        return {"": source}
    out = {}
    for path in sorted(source.rglob("*")):
        rel = path.relative_to(source)
        if path.is_file() and not SKIP_PARTS.intersection(rel.parts) and path.suffix != ".pyc":
            out[rel.as_posix()] = path
    return out


def as_deployed(data: bytes) -> bytes:
    """Text is deployed LF whatever the source repository stores (the adapter mixes CRLF and LF)."""
    return data if is_binary(data) else data.replace(b"\r\n", b"\n")


def lf_digest(data: bytes) -> str:
    """The digest a replacement contract and a source's lock compare: a text's with line endings normalised to LF,
    a binary's (a prebuilt kernel) of its bytes, so the lock shows the digest its manifest does."""
    return sha256(as_deployed(data))


class DeployKind:
    def __init__(self, spec: Deploy, ctx: Context) -> None:
        self.spec = spec
        if spec.pinned is not None:
            if spec.pinned not in ctx.pinned:
                raise ToolkitError(
                    f"transform {spec.id}: source {spec.pinned!r} is not available here",
                    hint=f"pass --source {spec.pinned}=PATH (a local checkout), or set sources[].path in the recipe",
                )
            self.source = ctx.pinned[spec.pinned] / spec.pinned_path
        else:
            self.source = ctx.patches_dir / spec.source
        if not self.source.exists():
            raise ToolkitError(
                f"transform {spec.id}: deploy source {self.source} not found",
                hint="fix `source` (relative to the recipe's patches folder) or add the file",
            )
        self.files = source_files(self.source)
        if not self.files:
            raise ToolkitError(f"transform {spec.id}: deploy source {self.source} holds no files")
        if spec.replaces is not None and list(self.files) != [""]:
            raise ToolkitError(f"transform {spec.id}: `replaces` contracts one file, but {self.source} is a folder",
                               hint="one deploy per replaced vendor file")
        self.check_replaced = True  # False only where the vendor files are stand-ins (the engine's trial mode)

    @property
    def rootfs_level(self) -> bool:
        return self.spec.dest.startswith("/")

    def targets(self, base: Path) -> dict[str, tuple[Path, Path]]:
        """Destination path relative to base -> (destination, source)."""
        dest = under(base, self.spec.dest)
        out = {}
        for rel, src in self.files.items():
            target = dest / rel if rel else dest
            out[target.relative_to(base).as_posix()] = (target, src)
        return out

    def contents(self, base: Path) -> dict[str, bytes]:
        """Root-relative destination -> the bytes deployed there."""
        return {rel: as_deployed(src.read_bytes()) for rel, (_, src) in self.targets(base).items()}

    def contract(self, rel: str, current: bytes | None, owned: dict[str, str], deployed: bytes) -> str | None:
        """Why replacing what is at `rel` would break the replacement contract, or None when it holds."""
        expected = self.spec.replaces
        if expected is None or not self.check_replaced:
            return None
        if current is None:
            return f"{rel}: the vendor file this deploy replaces is missing (expected sha256 {expected[:12]})"
        if current == deployed or owned.get(rel) == sha256(current) or lf_digest(current) == expected:
            return None
        return (f"{rel}: the vendor file changed (sha256 {lf_digest(current)[:12]}, LF-normalised; the replacement "
                f"was made from {expected[:12]}): replacing it would silently drop the vendor's change; compare "
                "them (toolkit diff), carry the change over, then update `replaces`")

    def plan(self, base: Path, owned: dict[str, str], patched: frozenset[str] = frozenset()) -> FilePlan:
        """patched: destinations that source transforms edit; the engine writes those, patched, itself."""
        ops: list[FileOp] = []
        conflicts: list[str] = []
        placed: list[tuple[str, str]] = []
        first_time = 0  # files the engine writes, patched, because transforms edit them
        for rel, (target, src) in self.targets(base).items():
            if self.spec.replaces is not None and rel not in patched:  # the engine checks the ones it patches
                current = target.read_bytes() if target.is_file() and not target.is_symlink() else None
                broken = self.contract(rel, current, owned, as_deployed(src.read_bytes()))
                if broken:
                    conflicts.append(broken)
                    continue
            if rel in patched:
                first_time += not target.exists()
                continue
            data = as_deployed(src.read_bytes())
            placed.append((rel, sha256(data)))
            mode = 0o755 if src.stat().st_mode & 0o111 else 0o644
            if target.is_symlink() or (target.exists() and not target.is_file()):
                conflicts.append(f"{rel} exists and is not a regular file")
                continue
            if target.is_file():
                current = target.read_bytes()
                if current == data:
                    continue
                ours = owned.get(rel) == sha256(current)
                if not (ours or self.spec.overwrite or self.spec.replaces):
                    conflicts.append(f"{rel} exists with other content (sha256 {sha256(current)[:12]})")
                    continue
            ops.append(FileOp(target, content=data, mode=mode))
        if conflicts:
            hint = "" if self.spec.replaces else OVERWRITE_HINT
            return FilePlan(State.DRIFTED, "; ".join(conflicts) + hint)
        mine = [rel for rel in self.targets(base) if rel in patched]
        note = f" (+{len(mine)} written patched by transforms)" if mine else ""
        if not ops and not first_time:
            return FilePlan(State.ALREADY_APPLIED, f"{len(placed)} file(s) in place{note}", owned=tuple(placed))
        return FilePlan(State.WOULD_APPLY, f"{len(ops)} of {len(placed)} file(s) written{note}", tuple(ops),
                        tuple(placed))


KIND = Kind(Deploy, DeployKind)
