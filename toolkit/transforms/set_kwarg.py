"""set-kwarg: set a keyword argument of a call inside a scope (un-hardcode a vendor literal)."""

from __future__ import annotations

from typing import Literal

import libcst as cst
from pydantic import Field

from toolkit.fields import DottedName, Identifier, PyExpr
from toolkit.transforms.base import Context, Kind, ModuleEdit, Sites, missing_scope, scope_or_none
from toolkit.transforms.cstutil import code_of, dotted_name, replace_nodes, same_expr, walk_scope


class SetKwarg(ModuleEdit):
    """Set a keyword argument of a call inside a scope (un-hardcode a literal)."""

    kind: Literal["set-kwarg"]
    call: DottedName = Field(description="The callee as written, e.g. ModelConfig or torch.ops.foo")
    arg: Identifier = Field(description="The keyword argument name")
    old: PyExpr | None = Field(default=None, description="The value it must have now (any value when omitted)")
    new: PyExpr = Field(description="The value to set")


class SetKwargKind:
    def __init__(self, spec: SetKwarg, ctx: Context) -> None:
        self.spec = spec

    def _expected(self) -> str:
        s = self.spec
        old = s.old if s.old is not None else "<any>"
        return f"{s.call}(..., {s.arg}={old}) -> {s.arg}={s.new}"

    def _sites(self, scope: cst.CSTNode) -> tuple[int, list[cst.Arg]]:
        calls = 0
        sites: list[cst.Arg] = []
        for node in walk_scope(scope):
            if isinstance(node, cst.Call) and dotted_name(node.func) == self.spec.call:
                calls += 1
                sites.extend(a for a in node.args if a.keyword is not None and a.keyword.value == self.spec.arg)
        return calls, sites

    def _is_pre(self, arg: cst.Arg) -> bool:
        if self.spec.old is not None:
            return same_expr(arg.value, self.spec.old)
        return not same_expr(arg.value, self.spec.new)

    def count(self, module: cst.Module) -> Sites:
        scope = scope_or_none(module, self.spec)
        if scope is None:
            return missing_scope(module, self.spec, self._expected())
        calls, sites = self._sites(scope)
        pre = sum(1 for a in sites if self._is_pre(a))
        post = sum(1 for a in sites if same_expr(a.value, self.spec.new))
        values = ", ".join(f"{self.spec.arg}={code_of(a.value).strip()}" for a in sites) or "no such keyword"
        found = f"{calls} call(s) to {self.spec.call} in scope, with {values}"
        at = "call" if not calls else "arg" if not sites else "old" if self.spec.old is not None else "new"
        if pre + post != len(sites):
            # a site with a third value is a changed vendor, never "already done"
            return Sites(0, 0, found, self._expected(), field=at)
        return Sites(pre, post, found, self._expected(), field=at)

    def rewrite(self, module: cst.Module) -> cst.Module:
        scope = scope_or_none(module, self.spec)
        assert scope is not None
        new_value = cst.parse_expression(self.spec.new)
        _, sites = self._sites(scope)
        targets = {id(a): (lambda n: n.with_changes(value=new_value)) for a in sites if self._is_pre(a)}
        return replace_nodes(module, targets, self.spec.scope)


KIND = Kind(SetKwarg, SetKwargKind)
