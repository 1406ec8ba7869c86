"""What every transform kind shares: the base models, the kind protocols, the registry entry, and the one place
source states are decided."""

from __future__ import annotations

import hashlib
import json
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import libcst as cst
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from pydantic import Field, field_validator

from toolkit.fields import ID_PATTERN, ScopeName, Strict, relative_path
from toolkit.results import State
from toolkit.transforms.cstutil import nearest_names, resolve_scope
from toolkit.transforms.files import FilePlan


class Gate(Strict):
    vendor_version: str | None = Field(
        default=None, description="Apply only when the root's vendor version matches this specifier"
    )

    @field_validator("vendor_version")
    @classmethod
    def _spec(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                SpecifierSet(value)
            except InvalidSpecifier:
                raise ValueError(f"not a version specifier: {value!r}") from None
        return value


class TransformBase(Strict):
    kind: str
    id: str = Field(pattern=ID_PATTERN, description="Unique id; it is also the marker name")
    why: str = Field(min_length=1, description="Provenance: why this change is needed")
    remove_when: str = Field(min_length=1, description="Provenance: when this change can be dropped")
    gate: Gate | None = Field(default=None, description="Conditions that exclude this transform (GATED_OFF)")
    package: str | None = Field(
        default=None, description="The package whose roots this transform edits: vendor.package (default) or "
        "a name declared under packages (e.g. transformers); paths are relative to that package's roots")
    requires: list[str] = Field(
        default_factory=list, description="Ids of transforms whose files this one needs at run time (e.g. an import "
        "of a deployed module): where they cannot be applied (a source not available here), neither is this one")

    # Fields that do not change what the transform does; a change to them must not make markers stale.
    provenance_fields: typing.ClassVar[frozenset[str]] = frozenset({"why", "remove_when", "requires"})

    @property
    def target_label(self) -> str:
        """What the transform changes, as shown in reports."""
        raise NotImplementedError(f"{type(self).__name__} must say what it changes")

    @property
    def pinned(self) -> str | None:
        """The declared source (under `sources:`) this transform takes files from, if any."""
        return None

    def patch_paths(self) -> list[str]:
        """Paths in the patches folder this transform reads (the submission's payload ships them)."""
        return []

    def digest(self) -> str:
        body = self.model_dump(mode="json", exclude=set(self.provenance_fields))
        if body.get("package") is None:
            body.pop("package", None)  # the default package: digests of existing transforms stay as they were
        raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(raw).hexdigest()[:12]


class ModuleEdit(TransformBase):
    file: str = Field(description="Module path relative to the vendor root, e.g. vllm/engine/arg_utils.py")
    scope: ScopeName = Field(default="",
                             description="Dotted scope inside the module, e.g. EngineArgs.create_model_config")
    expect: int = Field(default=1, ge=1, description="How many sites must match (the match contract)")
    # what the edit stands on: the whole scope (a kind that bypasses or replaces the function, so any change in it
    # changes what the edit means) or only the statements it rewrites (`toolkit upgrade` compares that part)
    anchors_whole_scope: typing.ClassVar[bool] = False

    @property
    def target_label(self) -> str:
        return self.file

    @field_validator("file")
    @classmethod
    def _py_file(cls, value: str) -> str:
        relative_path(value)
        if not value.endswith(".py"):
            raise ValueError(f"source transforms edit .py files, got {value!r}")
        return value



@dataclass(frozen=True)
class Context:
    """What a kind may need besides the file it edits."""

    patches_dir: Path
    pinned: dict[str, Path] = field(default_factory=dict)  # declared sources available here, at their commit
    device_arch: str | None = None  # the target's (hardware.device_arch): prebuilt kernels apply only for it
    platform: str | None = None  # the image's wheel platform tag (base_image.platform): a prebuilt kernel's CPU


@dataclass(frozen=True)
class Sites:
    """What a kind found in one module: sites in the pre-state and in the post-state."""

    pre: int
    post: int
    found: str  # a human description of what is there, for DRIFTED messages
    expected: str  # what the kind looks for
    nearest: tuple[str, ...] = field(default_factory=tuple)
    field: str | None = None  # the recipe field the mismatch is about (its line is what a DRIFTED result names)


class EditKind(Protocol):
    """One structural edit of one Python module."""

    @property
    def spec(self) -> ModuleEdit: ...

    def count(self, module: cst.Module) -> Sites: ...

    def rewrite(self, module: cst.Module) -> cst.Module: ...


def edit_key(kind: EditKind) -> str:
    """Everything an edit's count and rewrite depend on besides the module: a kind's code is fixed within a process,
    so its recipe model, plus what it read from outside the module (`read`: the text a replace-body takes from the
    patches folder). Evaluations are memoised by it: a key that missed an input would serve a stale rewrite."""
    read = getattr(kind, "read", None)
    return json.dumps([type(kind).__qualname__, kind.spec.model_dump(mode="json"), read], sort_keys=True)


class FileKind(Protocol):
    """A file or link placed in every vendor root (relative target) or in the image filesystem (absolute)."""

    @property
    def spec(self) -> TransformBase: ...

    @property
    def rootfs_level(self) -> bool: ...

    def plan(self, base: Path, owned: dict[str, str]) -> FilePlan: ...


@dataclass(frozen=True)
class Kind:
    """A registry entry: the recipe model of a kind and the behaviour that carries it out. Kinds whose model is a
    ModuleEdit edit Python modules (EditKind); the others place files (FileKind)."""

    model: type[TransformBase]
    behaviour: Callable[[Any, Context], EditKind | FileKind]

    @property
    def name(self) -> str:
        return str(typing.get_args(self.model.model_fields["kind"].annotation)[0])

    @property
    def edits_python(self) -> bool:
        return issubclass(self.model, ModuleEdit)


def missing_scope(module: cst.Module, spec: ModuleEdit, expected: str) -> Sites:
    near = tuple(nearest_names(module, spec.scope))
    return Sites(0, 0, f"no scope {spec.scope!r} in {spec.file}", expected, near, field="scope")


def scope_or_none(module: cst.Module, spec: ModuleEdit) -> cst.CSTNode | None:
    return resolve_scope(module, spec.scope)


@dataclass(frozen=True)
class Decision:
    state: State
    message: str
    field: str | None = None  # DRIFTED: the recipe field at fault, when one is


def decide(spec: ModuleEdit, sites: Sites, marker: str | None) -> Decision:
    """Turn the sites counted and the marker found in the file into one of the five states.

    WOULD_APPLY means "the pre-state is there as contracted": a plan rewrites it (APPLIED once written), a check
    reports it as not applied.
    """
    digest = spec.digest()
    where = f"{spec.file}" + (f" :: {spec.scope}" if spec.scope else "")
    if marker is not None and marker != digest:
        return Decision(
            State.DRIFTED,
            f"{where}: marker from another version of this transform (marker {marker}, recipe {digest}); "
            "the file holds a stale patch: reinstall the pristine vendor file and apply again",
        )
    if marker is not None:
        if sites.post == spec.expect:
            return Decision(State.ALREADY_APPLIED, f"{where}: marker and post-state present")
        return Decision(
            State.DRIFTED,
            f"{where}: marker present but post-state missing: expected {sites.expected} "
            f"x{spec.expect}, found {sites.found}", sites.field,
        )
    if sites.pre == spec.expect and sites.post == 0:
        return Decision(State.WOULD_APPLY, f"{where}: found {sites.found}")
    if sites.pre == 0 and sites.post == spec.expect:
        return Decision(
            State.SUPERSEDED,
            f"{where}: the pristine file already has the post-state without our marker: "
            "this patch may be removable",
        )
    near = f"; nearest names: {', '.join(sites.nearest)}" if sites.nearest else ""
    return Decision(
        State.DRIFTED,
        f"{where}: expected {sites.expected} exactly {spec.expect} time(s), found {sites.found} "
        f"(pre-state sites {sites.pre}, post-state sites {sites.post}){near}",
        sites.field or ("expect" if sites.pre + sites.post else None),
    )
