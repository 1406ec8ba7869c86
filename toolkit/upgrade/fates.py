"""Each transform's fate at a new commit of a source: tried on the new files by the engine's own evaluation (never
by text similarity alone), then compared with what it did at the old pin, by AST.

- carries: it applies, and what it stands on and what it changes are as at the old pin;
- moved: what it stands on is there, elsewhere or differently wrapped (inside a new `with`, a function now in another
  class or file, a renamed local or attribute): the proposed fields, found structurally, tried and shown as a diff;
- upstream: the new commit already has its post-state;
- conflict: what it stands on changed in meaning: both sides shown, nothing proposed;
- gone: its file or its scope is no longer there, and nothing moved in its place.
"""

from __future__ import annotations

import ast
import difflib
import enum
import io
import keyword
import textwrap
import tokenize
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import PurePosixPath

import libcst as cst
import libcst.matchers as m

from toolkit.engine.evaluate import Evaluation, evaluate
from toolkit.fields import PyBlock, PyExpr
from toolkit.recipe import Recipe
from toolkit.results import State
from toolkit.transforms import edit_kind
from toolkit.transforms.base import Context, ModuleEdit, decide
from toolkit.transforms.cstutil import module_code, qualnames, resolve_scope
from toolkit.transforms.deploy import Deploy, as_deployed
from toolkit.transforms.files import is_binary, sha256
from toolkit.transforms.kernels import Kernels

CONTEXT_LINES = 2  # of a transform's own diff: what "the code it changes" is compared with
AROUND_LINES = 60  # at most, of what changed in a transform's scope (the report says how much more there is)


class Fate(str, enum.Enum):
    CARRIES = "carries"
    MOVED = "moved"
    UPSTREAM = "upstream"
    CONFLICT = "conflict"
    GONE = "gone"

    @property
    def settled(self) -> bool:
        """Nothing is left for a person to decide."""
        return self not in (Fate.CONFLICT, Fate.GONE)


@dataclass(frozen=True)
class Outcome:
    """One transform's fate at the new commit."""

    transform: str
    kind: str
    file: str
    fate: Fate
    detail: str
    proposal: dict[str, str] = field(default_factory=dict)  # moved: recipe field -> its value at the new commit
    old_code: str = ""  # conflict: what it stood on at the old pin
    new_code: str = ""  # conflict: the nearest code at the new commit (shown, never proposed)
    diff: str = ""  # moved: what the transform would change there
    around: str = ""  # what changed in its scope (or file) between the commits
    decide: str = ""  # conflict and gone: what a person must decide
    renamed: tuple[str, str] | None = None  # moved by a rename: (old name, new name)

    def as_json(self) -> dict[str, typing.Any]:
        return {"transform": self.transform, "kind": self.kind, "file": self.file, "fate": self.fate.value,
                "detail": self.detail, "proposal": self.proposal, "old_code": self.old_code,
                "new_code": self.new_code, "diff": self.diff, "around": self.around, "decide": self.decide}


@dataclass(frozen=True)
class Side:
    """One commit of a source: the files the recipe uses from it (paths under its subdir), as git holds them; a path
    the commit lacks has no entry."""

    commit: str
    files: dict[str, bytes]


def classify(recipe: Recipe, source: str, old: Side, new: Side, ctx: Context) -> list[Outcome]:
    """The fate of every transform that reads the source's files or edits what a deploy from it places, in recipe
    order."""
    deploys = [t for t in recipe.transforms if isinstance(t, Deploy) and t.pinned == source]
    targets: dict[tuple[str | None, str], str] = {}
    for t in recipe.transforms:
        if isinstance(t, ModuleEdit) and (path := _deployed_from(t, deploys)) is not None:
            targets[(t.package, t.file)] = path
    placed = {(d.package, d.pinned_path): d.dest for d in deploys if d.pinned_path.endswith(".py")}
    found = {d.id: _deploy_fate(d, old, new) for d in deploys}
    return fates(recipe, targets, placed, old, new, ctx, found)


def fates(recipe: Recipe, targets: dict[tuple[str | None, str], str], placed: dict[tuple[str | None, str], str],
          old: Side, new: Side, ctx: Context, found: dict[str, Outcome] | None = None) -> list[Outcome]:
    """The fates of the edits of the files `targets` names ((package, edited file) -> its path in the Sides), with
    `placed` the Sides' Python files a transform may follow a function into ((package, path) -> edited file).

    A source gives the files its deploys place (`classify`); a vendor release would give its own files, each
    edited where it lies: the same machinery, another input."""
    out = dict(found or {})
    groups: dict[tuple[str | None, str], list[ModuleEdit]] = {}
    for t in recipe.transforms:
        if isinstance(t, ModuleEdit) and (t.package, t.file) in targets:
            groups.setdefault((t.package, t.file), []).append(t)
    files = _Files(old, new)
    for (package, rel), specs in groups.items():
        moves = {path: dest for (pkg, path), dest in placed.items() if pkg == package}
        for outcome in _FileFates(rel, targets[(package, rel)], specs, files, ctx, moves).outcomes():
            out[outcome.transform] = outcome
    return _merges([out[t.id] for t in recipe.transforms if t.id in out])


def _deployed_from(t: ModuleEdit, deploys: list[Deploy]) -> str | None:
    """The source path a deploy places at the file this transform edits."""
    for d in deploys:
        if d.package != t.package or not d.covers(t.file):
            continue
        dest, target = PurePosixPath(d.dest), PurePosixPath(t.file)
        if target == dest:
            return d.pinned_path
        if dest in target.parents:
            return str(PurePosixPath(d.pinned_path) / target.relative_to(dest))
    return None


def under(files: dict[str, bytes], path: str) -> dict[str, bytes]:
    """The files at `path` or below it."""
    return {p: b for p, b in files.items() if p == path or p.startswith(path + "/")}


def _deploy_fate(d: Deploy, old: Side, new: Side) -> Outcome:
    before, after = under(old.files, d.pinned_path), under(new.files, d.pinned_path)
    if not after:
        return Outcome(d.id, d.kind, d.dest, Fate.GONE,
                       f"@{d.pinned}/{d.pinned_path} is not in commit {new.commit[:12]}",
                       decide="the file it deploys is gone: remove the deploy, or deploy what replaced it")
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    if not changed:
        return Outcome(d.id, d.kind, d.dest, Fate.CARRIES, "the same bytes")
    counts, diffs = [], []
    for p in changed:
        if is_binary(before.get(p, b"")) or is_binary(after.get(p, b"")):  # a prebuilt kernel: its digests
            counts.append(f"{p} (binary: sha256 {sha256(before[p])[:12] if p in before else 'none'} -> "
                          f"{sha256(after[p])[:12] if p in after else 'none'})")
            continue
        a, b = _lines(before.get(p, b"")), _lines(after.get(p, b""))
        diff = list(difflib.unified_diff(a, b, f"{p} (old pin)", f"{p} (new commit)", n=1, lineterm=""))
        counts.append(f"{p} {_size(chr(10).join(diff))}")
        diffs.append("\n".join(_trimmed(diff)))
    if isinstance(d, Kernels):  # new artefacts come with a new manifest, whose digest the recipe pins
        return Outcome(d.id, d.kind, d.dest, Fate.CONFLICT, "the prebuilt artefacts changed: " + ", ".join(counts),
                       around="\n".join(diffs), decide="check the new manifest and set manifest_sha256 to its sha256 "
                       "(and make toolkit/runtime/references/corex_*.py follow the new .cu sources)")
    return Outcome(d.id, d.kind, d.dest, Fate.CARRIES,
                   "deploys the new commit's file(s), changed: " + ", ".join(counts), around="\n".join(diffs))


def _trimmed(lines: list[str]) -> list[str]:
    return lines if len(lines) <= AROUND_LINES else [*lines[:AROUND_LINES],
                                                      f"... {len(lines) - AROUND_LINES} more diff lines"]


def _lines(data: bytes) -> list[str]:
    return as_deployed(data).decode("utf-8", "replace").splitlines()


# a proposal tried: (fields -> values, source path, the module it was tried on, whether it applies, a rename)
_Candidate = tuple[dict[str, str], str, cst.Module, bool, tuple[str, str] | None]


class _Files:
    """The source's Python files at both commits, parsed once each (the adapter's model file is 3,000+ lines)."""

    def __init__(self, old: Side, new: Side) -> None:
        self.old, self.new = old, new
        self._parsed: dict[tuple[bool, str], cst.Module | None] = {}

    def data(self, path: str, newer: bool) -> bytes | None:
        data = (self.new if newer else self.old).files.get(path)
        return None if data is None else as_deployed(data)

    def module(self, path: str, newer: bool) -> cst.Module | None:
        key = (newer, path)
        if key not in self._parsed:
            data = self.data(path, newer)
            try:
                self._parsed[key] = None if data is None else cst.parse_module(data.decode("utf-8"))
            except (UnicodeDecodeError, cst.ParserSyntaxError):
                self._parsed[key] = None
        return self._parsed[key]


class _FileFates:
    """The fates of the transforms of one file, in recipe order (each sees the file as the ones before left it)."""

    def __init__(self, rel: str, path: str, specs: list[ModuleEdit], files: _Files, ctx: Context,
                 placed: dict[str, str]) -> None:
        self.rel, self.path, self.specs, self.files, self.ctx = rel, path, specs, files, ctx
        self.placed = placed  # the source's Python files a deploy places, where (a function may move between them)
        kinds = [edit_kind(s, ctx) for s in specs]
        self.before: Evaluation = evaluate(rel, files.data(path, False), kinds, None)
        self.after: Evaluation = evaluate(rel, files.data(path, True), kinds, None)

    def outcomes(self) -> Iterable[Outcome]:
        old_states = {v.spec.id: v for v in self.before.states}
        new_states = {v.spec.id: v for v in self.after.states}
        old_edits = {i: (b, a) for i, b, a in self.before.edits}
        new_edits = {i: (b, a) for i, b, a in self.after.edits}
        if self.files.data(self.path, True) is None:
            for spec in self.specs:
                yield self._out(spec, Fate.GONE, f"{self.path} is not in the new commit",
                                decide="the file it edits is gone: remove the transform, or point it at what "
                                "replaced the file")
            return
        current = self.files.module(self.path, True)  # the new file as the transforms before this one leave it
        for spec in self.specs:
            was, now = old_states[spec.id], new_states[spec.id]
            if was.state is not State.WOULD_APPLY:
                yield self._not_applied_before(spec, was.state, was.message, now.state, now.message)
            elif now.state is State.WOULD_APPLY:
                yield self._applies(spec, old_edits[spec.id], new_edits[spec.id])
            elif now.state is State.SUPERSEDED:
                yield self._out(spec, Fate.UPSTREAM, "the new commit already has its post-state: remove it",
                                around=self._around(spec))
            else:
                yield self._search(spec, old_edits[spec.id], current, now.message)
            if spec.id in new_edits:
                current = new_edits[spec.id][1]

    # -- the fates ---------------------------------------------------------------------------------------------
    def _out(self, spec: ModuleEdit, fate: Fate, detail: str, **extra: typing.Any) -> Outcome:
        if extra.get("around"):
            extra["around"] = "\n".join(_trimmed(extra["around"].splitlines()))
        return Outcome(spec.id, spec.kind, spec.file, fate, detail, **extra)

    def _not_applied_before(self, spec: ModuleEdit, was: State, why_was: str, now: State, why_now: str) -> Outcome:
        if was is State.DRIFTED:
            return self._out(spec, Fate.CONFLICT, f"DRIFTED at the old pin already ({why_was}); at the new commit: "
                             f"{now.value}", decide="fix the transform at its pin first (`toolkit diff`)")
        if now is was:
            return self._out(spec, Fate.UPSTREAM if now is State.SUPERSEDED else Fate.CARRIES,
                             f"{now.value} at both commits")
        if now is State.DRIFTED:
            return self._out(spec, Fate.CONFLICT, f"{was.value} at the old pin, DRIFTED at the new commit: {why_now}",
                             decide="decide what the transform must do in the new code")
        return self._out(spec, Fate.CONFLICT, f"{was.value} at the old pin, {now.value} at the new commit",
                         decide="decide whether the transform is still needed")

    def _applies(self, spec: ModuleEdit, old_edit: tuple[cst.Module, cst.Module],
                 new_edit: tuple[cst.Module, cst.Module]) -> Outcome:
        around = self._around(spec)
        if spec.anchors_whole_scope:
            old_scope = _scope_code(old_edit[0], spec.scope)
            new_scope = _scope_code(new_edit[0], spec.scope)
            if _same_ast(old_scope, new_scope):
                return self._out(spec, Fate.CARRIES, f"applies; {_scope_label(spec)} is the same by AST")
            return self._out(
                spec, Fate.CONFLICT, f"applies, but {_scope_label(spec)}, which it {_stands(spec)}, changed",
                old_code=old_scope, new_code=new_scope, around=around,
                decide=f"read what the new {_scope_label(spec)} does that the old one did not; keep {spec.id} only "
                "if its replacement still does all of it (the rehearsal's oracles judge the tokens)")
        old_hunk, new_hunk = _hunk(*old_edit), _hunk(*new_edit)
        if _tokens(old_hunk) != _tokens(new_hunk):
            return self._out(spec, Fate.CONFLICT, "applies, but the code it changes differs from the old pin's",
                             old_code=_side(old_hunk, "-"), new_code=_side(new_hunk, "-"), around=around,
                             decide="compare both sides: the transform's rewrite of the new code may not mean what "
                             "it meant")
        if _indent(_core(old_hunk)) != _indent(_core(new_hunk)):
            return self._out(spec, Fate.MOVED, "applies to the same code, differently wrapped (its indentation "
                             "changed): nothing in the recipe changes; the diff shows where",
                             diff=_diff_text(*new_edit), old_code=_side(old_hunk, "-"), around=around)
        detail = "applies; the code it changes is the same (comments and layout aside)"
        if _tokens(old_hunk, context=True) != _tokens(new_hunk, context=True):
            detail += ", the lines next to it changed"
        if around:
            detail += f"; around it, {_scope_label(spec)} changed ({_size(around)})"
        return self._out(spec, Fate.CARRIES, detail, around=around)

    def _search(self, spec: ModuleEdit, old_edit: tuple[cst.Module, cst.Module], current: cst.Module | None,
                why: str) -> Outcome:
        """DRIFTED at the new commit: what it stood on, looked for structurally, each candidate tried."""
        old_module = old_edit[0]
        old_code = _side(_hunk(*old_edit), "-") if not spec.anchors_whole_scope else _scope_code(old_module, spec.scope)
        tried = [*self._scope_moves(spec, current), *self._renames(spec, old_module, current)]
        found = [c for c in tried if c[3]]
        if len(found) == 1:
            proposal, _, module, _, renamed = found[0]
            kind = edit_kind(spec.model_copy(update=proposal), self.ctx)
            moved = ", ".join(f"{k}: {v!r}" for k, v in proposal.items() if k not in ("old", "new", "after"))
            said = moved or ("renamed " + " -> ".join(renamed) if renamed else "")
            return self._out(spec, Fate.MOVED, f"what it stands on moved ({said}); tried there: it applies",
                             proposal=proposal, diff=_diff_text(module, kind.rewrite(module)), renamed=renamed,
                             old_code=old_code,
                             around=self._around(spec))
        new_scope = _scope_code(current, spec.scope) if current is not None else ""
        if len(found) > 1:
            places = "; ".join(", ".join(f"{k}={v!r}" for k, v in c[0].items() if k in ("scope", "file", "calls"))
                               or str(c[4]) for c in found)
            return self._out(spec, Fate.CONFLICT, f"{len(found)} places in the new commit would take it: {places}",
                             old_code=old_code, new_code=new_scope, decide="choose the place (or none): the "
                             "toolkit does not guess between them")
        callee = getattr(spec, "calls", None)
        if current is not None and isinstance(callee, str) and callee.rsplit(".", 1)[-1] not in _names(current):
            return self._out(spec, Fate.GONE, f"{callee} is nowhere in the new {self.path}, and nothing took its "
                             "place", old_code=old_code, decide="remove the transform, or point it at the code that "
                             "does this now")
        if current is None or (not new_scope and spec.scope):
            return self._out(spec, Fate.GONE, f"{_scope_label(spec)} is not in the new commit, and no new function of "
                             "that name appeared", old_code=old_code, decide="remove the transform, or point it at "
                             "the code that does this now")
        nearest = _nearest(old_code, new_scope)
        return self._out(spec, Fate.CONFLICT, f"what it stands on changed: {why}", old_code=old_code,
                         new_code=nearest or new_scope, around=self._around(spec),
                         decide="rewrite the transform for the new code, or remove it if the new code no longer "
                         "needs it")

    # -- structural search ---------------------------------------------------------------------------------------
    def _try(self, spec: ModuleEdit, proposal: dict[str, str], module: cst.Module) -> bool:
        changed = spec.model_copy(update=proposal)
        kind = edit_kind(changed, self.ctx)
        return decide(changed, kind.count(module), None).state is State.WOULD_APPLY

    def _scope_moves(self, spec: ModuleEdit, current: cst.Module | None) -> list[_Candidate]:
        """Its function gone from where it was: a function of the same name that the new commit added, in this
        file or another of the source's (one that existed at the old pin is another function, never a move)."""
        if not spec.scope or current is None or resolve_scope(current, spec.scope) is not None:
            return []
        name = spec.scope.rsplit(".", 1)[-1]
        out: list[_Candidate] = []
        for path in sorted(set(self.placed) | {self.path}):
            new_module = self.files.module(path, True)
            if new_module is None:
                continue
            before = self.files.module(path, False)
            existed = set(qualnames(before)) if before is not None else set()
            for qual in qualnames(new_module):
                if qual.rsplit(".", 1)[-1] != name or qual in existed:
                    continue
                proposal = {"scope": qual} if path == self.path else {"scope": qual, "file": self.placed[path]}
                out.append((proposal, path, new_module, self._try(spec, {"scope": qual}, new_module), None))
        return out

    def _renames(self, spec: ModuleEdit, old_module: cst.Module, current: cst.Module | None) -> list[_Candidate]:
        """A name it uses gone from its scope, and a name the scope did not have before in its place: each such
        pair tried as a rename of the transform's code fields (a true rename only: a name that is still there, or
        one that was there before, is another variable, never a rename)."""
        if current is None:
            return []
        old_scope, new_scope = resolve_scope(old_module, spec.scope), resolve_scope(current, spec.scope)
        if old_scope is None or new_scope is None:
            return []
        had, has = _names(old_scope), _names(new_scope)
        fields = _code_fields(spec)
        out: list[_Candidate] = []
        for gone in sorted(had - has):
            if not any(_mentions(v, gone) for v in fields.values()):
                continue
            for came in sorted(has - had):
                proposal = {k: _rename(v, gone, came) for k, v in fields.items() if _mentions(v, gone)}
                out.append((proposal, self.path, current, self._try(spec, proposal, current), (gone, came)))
        return out

    def _around(self, spec: ModuleEdit) -> str:
        """What changed in the transform's scope (or, at module level, its file) between the commits."""
        old_module, new_module = self.files.module(self.path, False), self.files.module(self.path, True)
        if old_module is None or new_module is None:
            return ""
        a, b = _scope_code(old_module, spec.scope), _scope_code(new_module, spec.scope)
        if not a or not b or _same_ast(a, b):
            return ""
        return "\n".join(difflib.unified_diff(a.splitlines(), b.splitlines(), "old pin", "new commit", n=1,
                                             lineterm=""))


def _merges(outcomes: list[Outcome]) -> list[Outcome]:
    """Two transforms moved by renaming different names to one new name: the new code merged what they stood on,
    which is a person's decision, not two moves."""
    by_target: dict[tuple[str, str], list[Outcome]] = {}
    for o in outcomes:
        if o.fate is Fate.MOVED and o.renamed is not None:
            by_target.setdefault((o.file, o.renamed[1]), []).append(o)
    merged = {o.transform: group for group in by_target.values() if len({o.renamed for o in group}) > 1
              for o in group}
    out = []
    for o in outcomes:
        group = merged.get(o.transform)
        if group is None:
            out.append(o)
            continue
        names = " and ".join(sorted({g.renamed[0] for g in group if g.renamed}))
        others = ", ".join(g.transform for g in group if g.transform != o.transform)
        assert o.renamed is not None
        out.append(Outcome(o.transform, o.kind, o.file, Fate.CONFLICT,
                           f"{names} became one name, {o.renamed[1]}, at the new commit (merged; {others} stood on "
                           "the other)", old_code=o.old_code, new_code=o.diff, around=o.around,
                           decide=f"decide which transform stands on {o.renamed[1]} now, and what becomes of the "
                           "other"))
    return out


# -- code helpers ---------------------------------------------------------------------------------------------------
def _scope_label(spec: ModuleEdit) -> str:
    return spec.scope or spec.file


def _stands(spec: ModuleEdit) -> str:
    return "replaces" if spec.kind == "replace-body" else "bypasses when switched on"


def _scope_code(module: cst.Module | None, scope: str) -> str:
    if module is None:
        return ""
    node = resolve_scope(module, scope)
    if node is None:
        return ""
    return module.code if isinstance(node, cst.Module) else textwrap.dedent(module.code_for_node(node)).strip("\n")


def _same_ast(a: str, b: str) -> bool:
    try:
        return ast.dump(ast.parse(a)) == ast.dump(ast.parse(b))
    except SyntaxError:
        return a == b


def _hunk(before: cst.Module, after: cst.Module) -> list[str]:
    """The transform's own diff without line numbers: its context and its changed lines."""
    return [ln for ln in difflib.unified_diff(module_code(before).splitlines(), module_code(after).splitlines(),
                                              n=CONTEXT_LINES, lineterm="") if not ln.startswith(("---", "+++", "@@"))]


def _core(hunk: list[str]) -> list[str]:
    return [ln for ln in hunk if ln[:1] in "+-"]


def _tokens(hunk: list[str], context: bool = False) -> tuple[tuple[str, ...], ...]:
    """The Python tokens of a diff's removed and added lines (and, with context, the lines beside them), each side
    apart: comments, blank lines and layout left out."""
    signs = (" ", "-", "+") if context else ("-", "+")
    return tuple(_code_tokens("\n".join(ln[1:] for ln in hunk if ln[:1] == sign)) for sign in signs)


def _code_tokens(text: str) -> tuple[str, ...]:
    out: list[str] = []
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    try:
        for tok in tokenize.generate_tokens(io.StringIO(textwrap.dedent(text)).readline):
            if tok.type not in skip:
                out.append(tok.string)
    except (tokenize.TokenError, IndentationError):
        pass  # a statement the diff shows in part: the tokens up to where it stops
    return tuple(out)


def _indent(lines: list[str]) -> set[int]:
    return {len(ln[1:]) - len(ln[1:].lstrip()) for ln in lines if ln[1:].strip()}


def _side(hunk: list[str], sign: str) -> str:
    """One side of a diff (sign "-": the code before the transform ran)."""
    return textwrap.dedent("\n".join(ln[1:] for ln in hunk if ln[:1] in (" ", sign)))


def _diff_text(before: cst.Module, after: cst.Module) -> str:
    return "\n".join(difflib.unified_diff(module_code(before).splitlines(), module_code(after).splitlines(),
                                          "new commit", "transformed", n=CONTEXT_LINES, lineterm=""))


def _size(diff: str) -> str:
    lines = diff.splitlines()
    plus = sum(1 for ln in lines if ln.startswith("+") and not ln.startswith("+++"))
    minus = sum(1 for ln in lines if ln.startswith("-") and not ln.startswith("---"))
    return f"+{plus} -{minus} lines" if lines else ""


def _nearest(old: str, new_scope: str) -> str:
    """The run of the new scope's lines most like the old code (shown beside it; never proposed)."""
    want, lines = old.splitlines(), new_scope.splitlines()
    if not want or not lines:
        return ""
    size = len(want)
    best, at = 0.0, 0
    target = "\n".join(ln.strip() for ln in want)
    for start in range(max(1, len(lines) - size + 1)):
        window = "\n".join(ln.strip() for ln in lines[start:start + size])
        matcher = difflib.SequenceMatcher(None, target, window, autojunk=False)
        if matcher.quick_ratio() > best and (ratio := matcher.ratio()) > best:
            best, at = ratio, start
    return textwrap.dedent("\n".join(lines[at:at + size])) if best >= 0.5 else ""


def _names(node: cst.CSTNode) -> set[str]:
    """Every identifier in a scope: locals, parameters, attributes (`self.gate` gives `gate`)."""
    names = (n.value for n in m.findall(node, m.Name()) if isinstance(n, cst.Name))
    return {n for n in names if not keyword.iskeyword(n)}


def _code_fields(spec: ModuleEdit) -> dict[str, str]:
    """The fields of a transform that hold Python code (a rename applies to them)."""
    hints = typing.get_type_hints(type(spec), include_extras=True)
    out = {}
    for name in type(spec).model_fields:
        value = getattr(spec, name)
        if isinstance(value, str) and ({PyExpr, PyBlock} & set(typing.get_args(hints[name])) or
                                       hints[name] in (PyExpr, PyBlock)):
            out[name] = value
    return out


def _mentions(code: str, name: str) -> bool:
    """Whether a code field (a recipe's Python, validated when the recipe loaded) uses an identifier."""
    return name in _names(cst.parse_module(textwrap.dedent(code)))


class _Renamer(cst.CSTTransformer):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.Name:
        return updated.with_changes(value=self.new) if updated.value == self.old else updated


def _rename(code: str, old: str, new: str) -> str:
    """The code with one identifier renamed (as a name or an attribute), formatting kept."""
    renamed = cst.parse_module(textwrap.dedent(code)).visit(_Renamer(old, new)).code
    return renamed if code.endswith("\n") else renamed.rstrip("\n")
