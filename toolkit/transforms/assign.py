"""assign: replace or remove a plain `target = value` statement inside a scope."""

from __future__ import annotations

from typing import Literal

import libcst as cst
from pydantic import Field, model_validator

from toolkit.fields import Identifier, PyExpr
from toolkit.transforms.base import Context, Kind, ModuleEdit, Sites, missing_scope, scope_or_none
from toolkit.transforms.cstutil import code_of, replace_nodes, same_expr, walk_statements


class Assign(ModuleEdit):
    """Replace or remove a plain assignment `target = old` inside a scope."""

    kind: Literal["assign"]
    target: Identifier = Field(description="The assigned name")
    old: PyExpr | None = Field(default=None, description="The value assigned now (any value when omitted)")
    new: PyExpr | None = Field(default=None, description="The new value; omit to remove the statement")
    others: int = Field(
        default=0, ge=0,
        description="How many other assignments to the target the scope holds, before and after (e.g. upstream's "
        "own heuristic before a vendor override); any other count means the code changed: DRIFTED")

    @model_validator(mode="after")
    def _remove_needs_old(self) -> Assign:
        if self.new is None and self.old is None:
            raise ValueError("removing an assignment needs `old` so that only the intended statement goes")
        return self


class AssignKind:
    def __init__(self, spec: Assign, ctx: Context) -> None:
        self.spec = spec

    def _expected(self) -> str:
        s = self.spec
        old = s.old if s.old is not None else "<any>"
        return f"`{s.target} = {old}` -> " + ("removed" if s.new is None else f"`{s.target} = {s.new}`")

    def _sites(self, scope: cst.CSTNode) -> list[tuple[cst.SimpleStatementLine, cst.Assign, list[cst.CSTNode]]]:
        sites = []
        for stmt, path in walk_statements(scope):
            line = path[-1]
            if (
                isinstance(line, cst.SimpleStatementLine)
                and len(line.body) == 1
                and isinstance(stmt, cst.Assign)
                and len(stmt.targets) == 1
                and isinstance(stmt.targets[0].target, cst.Name)
                and stmt.targets[0].target.value == self.spec.target
            ):
                sites.append((line, stmt, path))
        return sites

    def _everywhere(self, module: cst.Module) -> list[cst.Assign]:
        """Every plain assignment to the target in the module, nested functions and classes included."""
        target = self.spec.target
        found: list[cst.Assign] = []

        class Collect(cst.CSTVisitor):
            def visit_Assign(self, node: cst.Assign) -> None:
                if (len(node.targets) == 1 and isinstance(node.targets[0].target, cst.Name)
                        and node.targets[0].target.value == target):
                    found.append(node)

        module.visit(Collect())
        return found

    def _is_pre(self, stmt: cst.Assign) -> bool:
        if self.spec.old is not None:
            return same_expr(stmt.value, self.spec.old)
        return self.spec.new is not None and not same_expr(stmt.value, self.spec.new)

    def _is_post(self, stmt: cst.Assign) -> bool:
        return self.spec.new is not None and same_expr(stmt.value, self.spec.new)

    def count(self, module: cst.Module) -> Sites:
        scope = scope_or_none(module, self.spec)
        if scope is None:
            return missing_scope(module, self.spec, self._expected())
        sites = self._sites(scope)
        pre = sum(1 for _, s, _ in sites if self._is_pre(s))
        post = sum(1 for _, s, _ in sites if self._is_post(s))
        others = len(sites) - pre - post
        shown = "; ".join(f"`{self.spec.target} = {code_of(s.value).strip()}`" for _, s, _ in sites)
        shown = shown or f"no assignment to {self.spec.target}"
        if others != self.spec.others:
            # a changed value is drift, never absence: only the declared number of other assignments may remain
            return Sites(0, 0, f"{shown} ({others} other assignment(s) to {self.spec.target}, the recipe "
                         f"declares others: {self.spec.others})", self._expected(),
                         field="old" if self.spec.old is not None else "others")  # a changed value, most often
        if self.spec.new is None and pre == 0:
            # a removal's post-state: the old statement gone from the scope and not moved elsewhere in the module
            inside = {id(s) for _, s, _ in sites}
            moved = sum(1 for s in self._everywhere(module) if id(s) not in inside and self._is_pre(s))
            if moved:
                return Sites(0, 0, f"{shown}; and `{self.spec.target} = {self.spec.old}` {moved} time(s) elsewhere "
                             f"in the module, outside {self.spec.scope or 'the module level'}", self._expected(),
                             field="scope")
            post = self.spec.expect
        elif self.spec.new is None:
            post = 0
        return Sites(pre, post, shown, self._expected(), field="old" if self.spec.old is not None else "target")

    def rewrite(self, module: cst.Module) -> cst.Module:
        scope = scope_or_none(module, self.spec)
        assert scope is not None
        targets = {}
        ancestors: set[int] = set()
        for line, stmt, path in self._sites(scope):
            if not self._is_pre(stmt):
                continue
            ancestors.update(id(n) for n in path)
            if self.spec.new is None:
                targets[id(line)] = lambda n: cst.RemoveFromParent()
            else:
                value = cst.parse_expression(self.spec.new)
                targets[id(stmt)] = lambda n, v=value: n.with_changes(value=v)  # type: ignore[misc]
        return replace_nodes(module, targets, self.spec.scope, ancestors)  # type: ignore[arg-type]


KIND = Kind(Assign, AssignKind)
