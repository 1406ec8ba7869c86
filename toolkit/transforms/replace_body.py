"""replace-body: swap a function's body for the body of a function kept in patches/src."""

from __future__ import annotations

import hashlib
import re
from typing import ClassVar, Literal

import libcst as cst
from pydantic import Field, field_validator

from toolkit.errors import ToolkitError
from toolkit.fields import DOTTED, banned, relative_path
from toolkit.transforms.base import Context, Kind, ModuleEdit, Sites, missing_scope, scope_or_none
from toolkit.transforms.cstutil import canonical_block, qualnames, replace_nodes


class ReplaceBody(ModuleEdit):
    """Replace a function body with the body of a function in patches/src."""

    kind: Literal["replace-body"]
    source: str = Field(description="path/in/patches.py:qualified.function whose body is used")
    old_digest: str | None = Field(
        default=None, description="sha256 prefix of the body being replaced (toolkit diff prints it)"
    )
    anchors_whole_scope: ClassVar[bool] = True  # the body it replaces

    def patch_paths(self) -> list[str]:
        return [self.source.partition(":")[0]]

    @field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        path, sep, qualname = value.partition(":")
        if not sep:
            raise ValueError(f"source must be path.py:function, got {value!r}")
        relative_path(path)
        if not re.fullmatch(DOTTED, qualname) or re.search(banned("."), qualname):
            raise ValueError(f"not a dotted Python name: {qualname!r}")
        return value


def _params(fn: cst.FunctionDef) -> list[str]:
    p = fn.params
    names = [x.name.value for x in (*p.posonly_params, *p.params, *p.kwonly_params)]
    if isinstance(p.star_arg, cst.Param):
        names.append("*" + p.star_arg.name.value)
    if p.star_kwarg is not None:
        names.append("**" + p.star_kwarg.name.value)
    return names


def body_digest(fn: cst.FunctionDef) -> str:
    assert isinstance(fn.body, cst.IndentedBlock)
    return hashlib.sha256(canonical_block(fn.body.body).encode()).hexdigest()[:12]


class ReplaceBodyKind:
    def __init__(self, spec: ReplaceBody, ctx: Context) -> None:
        self.spec = spec
        path, _, qualname = spec.source.partition(":")
        source_file = ctx.patches_dir / path
        try:
            self.read = source_file.read_text(encoding="utf-8")  # an input of the rewrite (base.edit_key)
            source_module = cst.parse_module(self.read)
        except FileNotFoundError:
            raise ToolkitError(
                f"transform {spec.id}: source file {source_file} not found",
                hint="fix `source` in the recipe (path relative to the patches folder)",
            ) from None
        found = qualnames(source_module).get(qualname)
        if not isinstance(found, cst.FunctionDef) or not isinstance(found.body, cst.IndentedBlock):
            functions = [n for n, v in qualnames(source_module).items() if isinstance(v, cst.FunctionDef)]
            raise ToolkitError(
                f"transform {spec.id}: no function {qualname!r} in {source_file}",
                hint=f"functions there: {', '.join(functions) or 'none'}",
            )
        self.source_fn = found
        self.source_body = canonical_block(found.body.body)

    def _expected(self) -> str:
        return f"function {self.spec.scope}{tuple(_params(self.source_fn))} with another body"

    def count(self, module: cst.Module) -> Sites:
        fn = scope_or_none(module, self.spec)
        if fn is None:
            return missing_scope(module, self.spec, self._expected())
        if not isinstance(fn, cst.FunctionDef) or not isinstance(fn.body, cst.IndentedBlock):
            return Sites(0, 0, f"{self.spec.scope} is not a function with a block body", self._expected(),
                         field="scope")
        if _params(fn) != _params(self.source_fn):
            return Sites(0, 0, f"signature {tuple(_params(fn))}", self._expected(), field="source")
        if canonical_block(fn.body.body) == self.source_body:
            return Sites(0, 1, "the replacement body", self._expected())
        digest = body_digest(fn)
        if self.spec.old_digest and not digest.startswith(self.spec.old_digest):
            return Sites(0, 0, f"a body with digest {digest} (recipe pins old_digest {self.spec.old_digest})",
                         self._expected(), field="old_digest")
        return Sites(1, 0, f"a body with digest {digest}", self._expected())

    def rewrite(self, module: cst.Module) -> cst.Module:
        fn = scope_or_none(module, self.spec)
        assert isinstance(fn, cst.FunctionDef) and isinstance(fn.body, cst.IndentedBlock)
        assert isinstance(self.source_fn.body, cst.IndentedBlock)
        new_fn = fn.with_changes(body=fn.body.with_changes(body=self.source_fn.body.body))
        return replace_nodes(module, {id(fn): lambda _: new_fn}, self.spec.scope)


KIND = Kind(ReplaceBody, ReplaceBodyKind)
