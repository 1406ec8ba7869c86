"""probe: time a region of vendor or adapter code, by qualified name, when TOOLKIT_PROFILE=1.

Three shapes, all inside one function (`scope`):
- the whole function: a decorator, innermost (so a dispatch at the top of its body stays where it is, and the fast
  path it takes is timed too); its `tokens` is a parameter, or an attribute path from one;
- `statements`: a run of statements, anchored as the `statements` kind anchors `old`, runs inside a `with`;
- `calls`: every call of the named callable in the function (nested defs excluded) goes through `timed`.

    import native_fastpaths.profiling as _toolkit_profile          # once per module, after its docstring
    @_toolkit_profile.probe("step.forward.layer.gdn", tokens="hidden_states")
    def forward(self, hidden_states, ...): ...
    with _toolkit_profile.region("step.begin_forward") if _toolkit_profile.ON else _toolkit_profile.OFF:
        <the statements>
    ... _toolkit_profile.timed("step.forward.layer.moe.routed", self._pure_pytorch_experts)(hidden, logits) ...

Off (the default) the decorator returns the function itself (nothing added per call), a region reads one global and
enters a null context, `timed` returns the callable: no clock is read (benchmarks/profile_cost.py measures the
paths). A probe must not change another transform's anchor: probe calls and statements that no other transform
anchors on, or include that transform's post-state in the run. The runtime is
`patches/src/native_fastpaths/profiling.py`; a recipe that probes deploys it (`requires` the deploy) and the
import is part of the post-state.
"""

from __future__ import annotations

import ast
import re
from typing import Any, Literal

import libcst as cst
from pydantic import Field, field_validator, model_validator

from toolkit.fields import PyBlock, PyExpr, Strict
from toolkit.transforms.base import Context, Kind, ModuleEdit, Sites, missing_scope, scope_or_none
from toolkit.transforms.cstutil import canonical, canonical_block, code_of, replace_nodes, walk_scope
from toolkit.transforms.statements import canonical_statements, docstring_end, parse_block, suites

REGION_PATTERN = r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*$"
BUCKET_PATTERN = r"^[a-z][a-z0-9_]*$"
ALIAS = "_toolkit_profile"


class Bucket(Strict):
    """Which bucket an outermost region's time goes to (a region inside another takes the enclosing bucket)."""

    tokens: PyExpr | None = Field(
        default=None, description="An expression at the probed site whose value is the token count: an int, or a "
        "tensor whose first dimension is, e.g. hidden_states or attn_metadata.num_prefill_tokens")
    edges: dict[str, int | None] | None = Field(
        default=None, description="With tokens: bucket -> the most tokens it takes, in order; null: the rest "
        "(default {decode: 1, prefill: null})")
    name: str | None = Field(default=None, pattern=BUCKET_PATTERN, description="A fixed bucket instead")

    @model_validator(mode="after")
    def _one_rule(self) -> Bucket:
        if (self.tokens is None) == (self.name is None):
            raise ValueError("give `tokens` (a token count, bucketed by `edges`) or a fixed `name`, one of them")
        if self.edges is not None:
            if self.tokens is None:
                raise ValueError("`edges` bucket a token count: give `tokens` too")
            if not self.edges:
                raise ValueError("`edges` is empty")
            for key in self.edges:
                if not re.match(BUCKET_PATTERN, key):
                    raise ValueError(f"bucket name {key!r} must match {BUCKET_PATTERN}")
            bounds = [v for v in self.edges.values() if v is not None]
            if bounds != sorted(bounds) or list(self.edges.values()).count(None) > 1 or (
                    None in self.edges.values() and list(self.edges.values())[-1] is not None):
                raise ValueError("`edges` must rise, with at most one null (the rest), last")
        return self


class Probe(ModuleEdit):
    """Time a function, a run of statements in it, or the calls of a callable in it, as a named region."""

    kind: Literal["probe"]
    region: str = Field(pattern=REGION_PATTERN, description="The region's dotted name; `a.b` nests under `a`")
    statements: PyBlock | None = Field(default=None, description="The consecutive statements to time")
    calls: PyExpr | None = Field(default=None, description="The callable whose calls are timed, e.g. "
                                 "self._pure_pytorch_experts")
    bucket: Bucket | None = Field(default=None, description="The bucket rule for when this region is outermost "
                                  "(none: the enclosing region's bucket, or `all`)")
    runtime: str = Field(default="native_fastpaths.profiling", pattern=r"^[A-Za-z_][A-Za-z0-9_.]*$",
                         description="The runtime module the probed code imports (deployed with the recipe)")

    @model_validator(mode="after")
    def _shape(self) -> Probe:
        if not self.scope:
            raise ValueError("a probe needs the function it times as `scope`, e.g. ModelRunner.execute_model")
        if self.statements is not None and self.calls is not None:
            raise ValueError("give `statements` or `calls`, not both (neither: the whole function)")
        return self

    @field_validator("calls")
    @classmethod
    def _callable(cls, value: str | None) -> str | None:
        if value is not None and not isinstance(ast.parse(value, mode="eval").body, ast.Name | ast.Attribute):
            raise ValueError(f"`calls` names a callable (a name or attribute chain), got {value!r}")
        return value


class ProbeKind:
    def __init__(self, spec: Probe, ctx: Context) -> None:
        self.spec = spec
        self.run = canonical_statements(parse_block(spec.statements)) if spec.statements is not None else None
        self.importing = cst.parse_statement(f"import {spec.runtime} as {ALIAS}\n")
        assert isinstance(self.importing, cst.SimpleStatementLine)
        self.import_key = canonical_block([self.importing])

    # -- what the post-state looks like -------------------------------------------------------------------
    def _rule_args(self, tokens_by_name: bool = False) -> str:
        """The bucket rule as call arguments; a decorator names its token source (`tokens="x"`), the other shapes
        pass the value."""
        b = self.spec.bucket
        if b is None:
            return ""
        if b.name is not None:
            return f", bucket={b.name!r}"
        out = f", tokens={b.tokens!r}" if tokens_by_name else f", {b.tokens}"
        if b.edges is not None:
            out += ", buckets=(" + ", ".join(f"({k!r}, {v!r})" for k, v in b.edges.items()) + ",)"
        return out

    def _region_call(self) -> str:
        return f"{ALIAS}.region({self.spec.region!r}{self._rule_args()})"

    def _with_header(self) -> str:
        return f"with {self._region_call()} if {ALIAS}.ON else {ALIAS}.OFF:"

    def _with_key(self) -> str:
        return canonical(f"{self._region_call()} if {ALIAS}.ON else {ALIAS}.OFF")

    def _decorator(self) -> str:
        return f"{ALIAS}.probe({self.spec.region!r}{self._rule_args(tokens_by_name=True)})"

    def timed_func(self) -> str:
        return f"{ALIAS}.timed({self.spec.region!r}, {self.spec.calls}{self._rule_args()})"

    def _ours(self, stmt: cst.CSTNode) -> bool:
        if not isinstance(stmt, cst.With) or len(stmt.items) != 1:
            return False
        try:
            return canonical(stmt.items[0].item) == self._with_key()
        except SyntaxError:
            return False

    def _imported(self, module: cst.Module) -> bool:
        return any(canonical_block([s]) == self.import_key for s in module.body
                   if isinstance(s, cst.SimpleStatementLine))

    def _expected(self) -> str:
        s = self.spec
        what = (f"calls of {s.calls}" if s.calls is not None else
                f"statements `{_short(s.statements or '')}`" if s.statements is not None else "the function body")
        return f"{what} in {s.scope} timed as region {s.region!r}"

    # -- counting -----------------------------------------------------------------------------------------
    def count(self, module: cst.Module) -> Sites:
        fn = scope_or_none(module, self.spec)
        if fn is None:
            return missing_scope(module, self.spec, self._expected())
        if not isinstance(fn, cst.FunctionDef) or not isinstance(fn.body, cst.IndentedBlock):
            return Sites(0, 0, f"{self.spec.scope} is a {type(fn).__name__}, not a function", self._expected(),
                         field="scope")
        refused = self._refusal(fn)
        if refused:
            return Sites(0, 0, refused, self._expected(), field="bucket" if "parameter" in refused else "scope")
        pre, post = self._count(fn)
        if post and not self._imported(module):
            found = f"{post} timed site(s) but no `import {self.spec.runtime} as {ALIAS}` at module level"
            return Sites(pre, 0, found, self._expected(), field="region")
        field = "calls" if self.spec.calls is not None else "statements" if self.spec.statements else "scope"
        return Sites(pre, post, f"{pre} untimed site(s), {post} timed", self._expected(), field=field)

    def _count(self, fn: cst.FunctionDef) -> tuple[int, int]:
        if self.spec.calls is not None:
            pre = post = 0
            for node in walk_scope(fn):
                if isinstance(node, cst.Call):
                    if self.is_callee(node.func):
                        pre += 1
                    elif self._is_timed(node.func):
                        post += 1
            return pre, post
        if self.run is None:
            key = canonical(self._decorator())
            done = sum(1 for d in fn.decorators if canonical(d.decorator) == key)
            return (0, done) if done else (1, 0)
        wrapped = self._wrapped_bodies(fn)
        runs = sum(len(found) for _, found in self._runs(fn, set()))
        post = len(wrapped)
        return runs - post, post

    def _refusal(self, fn: cst.FunctionDef) -> str | None:
        """Why this function cannot be probed as declared; the token count must come from a parameter in every
        shape, so the probed code can never meet an unbound name (`timed` evaluates it even when off)."""
        if self.spec.statements is None and self.spec.calls is None:
            if fn.asynchronous is not None:
                return f"{self.spec.scope} is async (time its awaited calls with `calls` instead)"
            if _generator(fn):
                return f"{self.spec.scope} is a generator (its time would be its consumer's)"
        b = self.spec.bucket
        if b is not None and b.tokens is not None:
            head = b.tokens.split(".")[0]
            p = fn.params
            names = [param.name.value for param in (*p.posonly_params, *p.params, *p.kwonly_params)]
            if not all(part.isidentifier() for part in b.tokens.split(".")) or head not in names:
                return (f"bucket tokens {b.tokens!r} must be a parameter of {self.spec.scope} or an attribute path "
                        f"from one (parameters: {', '.join(names)})")
        return None

    def is_callee(self, func: cst.BaseExpression) -> bool:
        return isinstance(func, cst.Name | cst.Attribute) and canonical(func) == canonical(self.spec.calls or "")

    def _is_timed(self, func: cst.BaseExpression) -> bool:
        try:
            return isinstance(func, cst.Call) and canonical(func) == canonical(self.timed_func())
        except SyntaxError:
            return False

    def _wrapped_bodies(self, fn: cst.FunctionDef) -> set[int]:
        """Ids of the bodies of our `with` statements that hold exactly the run."""
        out = set()
        for node in walk_scope(fn):
            if self._ours(node):
                assert isinstance(node, cst.With) and isinstance(node.body, cst.IndentedBlock)
                if canonical_statements(node.body.body) == self.run:
                    out.add(id(node.body))
        return out

    def _runs(self, fn: cst.FunctionDef, skip: set[int]) -> list[tuple[cst.IndentedBlock, list[int]]]:
        """Per statement list (except those in `skip`), the indexes where the run starts."""
        assert self.run is not None
        size, out = len(self.run), []
        for suite in suites(fn):
            if id(suite) in skip or not isinstance(suite, cst.IndentedBlock):
                continue
            canon = canonical_statements(suite.body)
            starts = [i for i in range(len(canon)) if tuple(canon[i:i + size]) == self.run]
            if starts:
                out.append((suite, starts))
        return out

    # -- rewriting ----------------------------------------------------------------------------------------
    def rewrite(self, module: cst.Module) -> cst.Module:
        fn = scope_or_none(module, self.spec)
        assert isinstance(fn, cst.FunctionDef) and isinstance(fn.body, cst.IndentedBlock)
        if self.spec.calls is not None:
            timed_fn = fn.visit(_TimeCalls(self))
            assert isinstance(timed_fn, cst.FunctionDef)
            module = replace_nodes(module, {id(fn): lambda _: timed_fn}, self.spec.scope)
        elif self.run is None:
            # innermost, right above the def: what stood between the decorators and the def (the vendor's
            # commented-out @dump_input_when_exception) stays above ours
            ours = cst.Decorator(decorator=cst.parse_expression(self._decorator()),
                                 leading_lines=fn.lines_after_decorators if fn.decorators else ())
            new_fn = fn.with_changes(decorators=[*fn.decorators, ours],
                                     lines_after_decorators=() if fn.decorators else fn.lines_after_decorators)
            module = replace_nodes(module, {id(fn): lambda _: new_fn}, self.spec.scope)
        else:
            size = len(self.run)
            targets = {}
            for suite, starts in self._runs(fn, self._wrapped_bodies(fn)):
                def edit(node: cst.CSTNode, starts: list[int] = starts) -> cst.CSTNode:
                    assert isinstance(node, cst.IndentedBlock)
                    body = list(node.body)
                    for i in sorted(starts, reverse=True):
                        body[i:i + size] = [self._wrap(body[i:i + size])]
                    return node.with_changes(body=body)

                targets[id(suite)] = edit
            module = replace_nodes(module, targets, self.spec.scope)  # type: ignore[arg-type]
        return module if self._imported(module) else _add_import(module, self.importing)

    def _wrap(self, statements: list[cst.BaseStatement]) -> cst.With:
        template = cst.parse_statement(f"{self._with_header()}\n    pass\n")
        assert isinstance(template, cst.With) and isinstance(template.body, cst.IndentedBlock)
        first = statements[0]
        leading = first.leading_lines if isinstance(first, cst.SimpleStatementLine | cst.BaseCompoundStatement) \
            else ()
        inner = [first.with_changes(leading_lines=()) if leading else first, *statements[1:]]
        # the run's leading comments and blank lines stay above it, on the `with`
        return template.with_changes(body=template.body.with_changes(body=inner), leading_lines=leading)


_SCOPES = (cst.FunctionDef, cst.ClassDef, cst.Lambda)


class _TimeCalls(cst.CSTTransformer):
    def __init__(self, kind: ProbeKind) -> None:
        super().__init__()
        self.kind = kind
        self.depth = 0  # 1: the probed function itself; deeper: a nested def, class or lambda (a scope of its own)

    def on_visit(self, node: cst.CSTNode) -> bool:
        if isinstance(node, _SCOPES):
            self.depth += 1
        return super().on_visit(node)

    def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode) -> Any:
        if isinstance(original, _SCOPES):
            self.depth -= 1
        return super().on_leave(original, updated)

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        # depth 1: the probed function itself
        if self.depth == 1 and self.kind.is_callee(original.func):
            return updated.with_changes(func=cst.parse_expression(self.kind.timed_func()))
        return updated


def _generator(fn: cst.FunctionDef) -> bool:
    return any(isinstance(node, cst.Yield) for node in walk_scope(fn))


def _add_import(module: cst.Module, stmt: cst.SimpleStatementLine | cst.BaseCompoundStatement) -> cst.Module:
    """After the module docstring and the `from __future__` imports, where an import may go."""
    body = list(module.body)
    at = docstring_end(module)
    while at < len(body) and isinstance(body[at], cst.SimpleStatementLine) and any(
            isinstance(s, cst.ImportFrom) and s.module is not None and code_of(s.module) == "__future__"
            for s in body[at].body):  # type: ignore[union-attr]
        at += 1
    body.insert(at, stmt)
    return module.with_changes(body=body)


def _short(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= 60 else flat[:57] + "..."


KIND = Kind(Probe, ProbeKind)
