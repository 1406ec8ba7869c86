"""The protocol every source transform kind implements, and the one place states are decided."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import libcst as cst

from toolkit.recipe import SourceTransform
from toolkit.results import State
from toolkit.transforms.cstutil import nearest_names, resolve_scope


@dataclass(frozen=True)
class Context:
    """What a kind may need besides the file it edits."""

    patches_dir: Path
    trees: dict[str, Path] = field(default_factory=dict)  # declared sources available here, at their commit


@dataclass(frozen=True)
class Probe:
    """What a kind found in one module: sites in the pre-state and in the post-state."""

    pre: int
    post: int
    found: str  # a human description of what is there, for DRIFTED messages
    expected: str  # what the kind looks for
    nearest: tuple[str, ...] = field(default_factory=tuple)


class SourceKind(Protocol):
    """One structural edit of one Python module."""

    @property
    def spec(self) -> SourceTransform: ...

    def probe(self, module: cst.Module) -> Probe: ...

    def rewrite(self, module: cst.Module) -> cst.Module: ...


def missing_scope(module: cst.Module, spec: SourceTransform, expected: str) -> Probe:
    near = tuple(nearest_names(module, spec.scope))
    return Probe(0, 0, f"no scope {spec.scope!r} in {spec.file}", expected, near)


def scope_or_none(module: cst.Module, spec: SourceTransform) -> cst.CSTNode | None:
    return resolve_scope(module, spec.scope)


@dataclass(frozen=True)
class Decision:
    state: State
    message: str


def decide(spec: SourceTransform, probe: Probe, marker: str | None) -> Decision:
    """Turn a probe and the marker found in the file into one of the five states.

    APPLIED here means "the pre-state is there as contracted": apply rewrites it, verify reports it
    as not applied.
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
        if probe.post == spec.expect:
            return Decision(State.ALREADY_APPLIED, f"{where}: marker and post-state present")
        return Decision(
            State.DRIFTED,
            f"{where}: marker present but post-state missing: expected {probe.expected} "
            f"x{spec.expect}, found {probe.found}",
        )
    if probe.pre == spec.expect and probe.post == 0:
        return Decision(State.APPLIED, f"{where}: found {probe.found}")
    if probe.pre == 0 and probe.post == spec.expect:
        return Decision(
            State.SUPERSEDED,
            f"{where}: the pristine file already has the post-state without our marker: "
            "this patch may be removable",
        )
    near = f"; nearest names: {', '.join(probe.nearest)}" if probe.nearest else ""
    return Decision(
        State.DRIFTED,
        f"{where}: expected {probe.expected} exactly {spec.expect} time(s), found {probe.found} "
        f"(pre-state sites {probe.pre}, post-state sites {probe.post}){near}",
    )
