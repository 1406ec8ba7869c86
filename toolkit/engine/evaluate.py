"""The one per-file evaluation of source transforms, shared by apply, diff, `--dry-run` and verify: decode, parse,
decide each transform's state from its sites and marker, and (planning) rewrite what is due, or (checking) report
what is missing."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field, replace

import libcst as cst
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from toolkit.engine.codec import TextFile
from toolkit.markers import append_markers, read_markers
from toolkit.results import State
from toolkit.transforms.base import EditKind, ModuleEdit, TransformBase, decide, edit_key

NOT_APPLIED = "not applied: the pre-state is still there (run `toolkit apply`)"


def gated_off(spec: TransformBase, version: str | None) -> str | None:
    """Why a transform is excluded in a root, or None when it applies."""
    if spec.gate is None or spec.gate.vendor_version is None:
        return None
    if version is None:
        return None  # checked by the caller: unknown version with a version gate is an input problem
    try:
        matches = Version(version) in SpecifierSet(spec.gate.vendor_version)
    except InvalidVersion:
        return None
    return None if matches else f"vendor version {version} is outside {spec.gate.vendor_version}"


@dataclass(frozen=True)
class Verdict:
    """One transform's state in one file; `field` names the recipe field at fault when it DRIFTED."""

    spec: ModuleEdit
    state: State
    message: str
    field: str | None = None


@dataclass
class Evaluation:
    """The states of the transforms of one file, and (planning) the file's new text."""

    states: list[Verdict] = field(default_factory=list)
    codec: TextFile | None = None
    text: str | None = None  # planning, nothing drifted: the file's text, with the new markers when rewritten
    edits: list[tuple[str, cst.Module, cst.Module]] = field(default_factory=list)  # (transform, before, after)
    unreadable: str | None = None  # why the file could not be read

    @property
    def drifted(self) -> bool:
        return any(v.state is State.DRIFTED for v in self.states)


def _read(rel: str, data: bytes, check: bool) -> tuple[TextFile, cst.Module] | str:
    try:
        codec = TextFile.decode(data)
        if check:  # a checked tree must compile as it is; a planned one is compiled after the rewrite
            compile(data, rel, "exec", dont_inherit=True)
        return codec, cst.parse_module(codec.text)
    except UnicodeDecodeError as exc:
        return f"not UTF-8 ({exc.reason})"
    except SyntaxError as exc:
        return f"does not compile ({exc.msg} at line {exc.lineno})"
    except cst.ParserSyntaxError as exc:
        return f"does not parse ({exc.message} at {exc.raw_line}:{exc.raw_column})"


# One build plans each file twice (the build, then preflight's patched copy) and a test process plans the same
# trees many times; parsing and rewriting is most of that time. An evaluation is a function of the key alone.
_MEMO: OrderedDict[tuple[object, ...], Evaluation] = OrderedDict()
MEMO_SIZE = 64  # files (the flagship edits 17); an entry holds each edit's libcst modules, ~36x the source


def evaluate(rel: str, data: bytes | None, kinds: list[EditKind], version: str | None, *, check: bool = False,
             marked: Collection[str] = ()) -> Evaluation:
    """Plan (check=False: rewrite what is due, then compile the result) or check (check=True: what is due is
    missing, and so is a marker `marked` says toolkit wrote) the transforms `kinds` of the file `rel`."""
    key = (rel, None if data is None else hashlib.sha256(data).digest(), tuple(edit_key(k) for k in kinds), version,
           check, tuple(sorted(marked)) if check else ())
    found = _MEMO.get(key)
    if found is None:
        found = _MEMO[key] = _evaluate(rel, data, kinds, version, check, marked)
        while len(_MEMO) > MEMO_SIZE:
            _MEMO.popitem(last=False)
    else:
        _MEMO.move_to_end(key)
    # the memo's lists are its own: a caller that extends its copy changes no later answer
    return replace(found, states=list(found.states), edits=list(found.edits))


def _evaluate(rel: str, data: bytes | None, kinds: list[EditKind], version: str | None, check: bool,
              marked: Collection[str]) -> Evaluation:
    out = Evaluation()
    specs = [k.spec for k in kinds]
    if data is None:
        out.states = [Verdict(t, State.DRIFTED, f"{rel}: file not found in the vendor root", "file") for t in specs]
        return out
    read = _read(rel, data, check)
    if isinstance(read, str):
        out.unreadable = read
        out.states = [Verdict(t, State.DRIFTED, f"{rel}: {read}") for t in specs]
        return out
    out.codec, module = read
    markers = read_markers(out.codec.text)
    new_markers: list[tuple[str, str]] = []
    for kind in kinds:
        spec = kind.spec
        why_off = gated_off(spec, version)
        if why_off:
            out.states.append(Verdict(spec, State.GATED_OFF, why_off, "gate"))
            continue
        decision = decide(spec, kind.count(module), markers.get(spec.id))
        state, message, at = decision.state, decision.message, decision.field
        if check and state is State.WOULD_APPLY:
            state, message = State.DRIFTED, f"{rel}: {NOT_APPLIED}"
        elif check and state is State.SUPERSEDED and spec.id in marked:
            state, message = State.DRIFTED, (f"{rel}: marker missing although toolkit applied this transform here "
                                             "(per its state file); the file was edited after apply")
        elif state is State.WOULD_APPLY:
            before, module = module, kind.rewrite(module)
            sites = kind.count(module)
            if sites.post != spec.expect or sites.pre != 0:
                state, message = State.DRIFTED, (f"{rel}: rewrite did not reach the post-state (found "
                                                 f"{sites.found}); this is a toolkit bug, please report it")
                module = before
            else:
                new_markers.append((spec.id, spec.digest()))
                out.edits.append((spec.id, before, module))
        out.states.append(Verdict(spec, state, message, at))
    if check or out.drifted:
        return out
    text = append_markers(module.code, new_markers) if new_markers else out.codec.text
    try:
        compile(text, rel, "exec", dont_inherit=True)
    except SyntaxError as exc:
        out.states.append(Verdict(specs[-1], State.DRIFTED, f"{rel}: patched file does not compile: {exc}"))
        return out
    out.text = text
    return out
