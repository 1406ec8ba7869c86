"""add-import: `import module` or `from module import names`, placed after the module's imports."""

from __future__ import annotations

from typing import Literal

import libcst as cst
from pydantic import Field, model_validator

from toolkit.fields import DottedName, Identifier
from toolkit.transforms.base import Context, Kind, ModuleEdit, Sites


class AddImport(ModuleEdit):
    """Add `import module` or `from module import names` after the module's imports."""

    kind: Literal["add-import"]
    module: DottedName
    names: list[Identifier] = Field(default_factory=list,
                                    description="Names to import from the module (empty: import it)")

    @model_validator(mode="after")
    def _module_scope(self) -> AddImport:
        if self.scope:
            raise ValueError("add-import works at module level; leave `scope` empty")
        return self


def _module_name(node: cst.BaseExpression | None) -> str:
    return "" if node is None else cst.Module(body=[]).code_for_node(node)


class AddImportKind:
    def __init__(self, spec: AddImport, ctx: Context) -> None:
        self.spec = spec

    def _statement_code(self) -> str:
        if self.spec.names:
            return f"from {self.spec.module} import {', '.join(self.spec.names)}"
        return f"import {self.spec.module}"

    def _imported(self, module: cst.Module) -> bool:
        have_module = False
        names: set[str] = set()
        for line in module.body:
            if not isinstance(line, cst.SimpleStatementLine):
                continue
            for small in line.body:
                if isinstance(small, cst.Import):
                    have_module |= any(
                        _module_name(a.name) == self.spec.module and a.asname is None for a in small.names)
                elif (isinstance(small, cst.ImportFrom) and _module_name(small.module) == self.spec.module
                      and not isinstance(small.names, cst.ImportStar)):
                    names.update(a.name.value for a in small.names
                                 if isinstance(a.name, cst.Name) and a.asname is None)
        return set(self.spec.names) <= names if self.spec.names else have_module

    def count(self, module: cst.Module) -> Sites:
        done = self._imported(module)
        return Sites(
            0 if done else 1, 1 if done else 0,
            f"`{self._statement_code()}` " + ("present" if done else "absent"),
            f"module without `{self._statement_code()}`",
        )

    def rewrite(self, module: cst.Module) -> cst.Module:
        body = list(module.body)
        at = 0
        for i, stmt in enumerate(body):
            if isinstance(stmt, cst.SimpleStatementLine) and all(
                isinstance(s, cst.Import | cst.ImportFrom) for s in stmt.body
            ):
                at = i + 1
            elif i == 0 and isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Expr):
                at = 1  # after the module docstring
        body.insert(at, cst.parse_statement(self._statement_code() + "\n"))
        return module.with_changes(body=body)


KIND = Kind(AddImport, AddImportKind)
