"""dispatch: an env-gated early return into an injected fast path at the top of a function.

    if __import__("pkg.switches", fromlist=["on"]).on("SWITCH") [and (WHEN)]:
        from pkg.mod import func as _toolkit_<id>
        return _toolkit_<id>(args...)

With the switch off the original body runs untouched. `__import__` keeps the dispatch one
self-contained statement, so it needs no import elsewhere in the vendor module. The switch is read by the injected
package's own `switches.py` (beside its `switches.json`), the one strict reader every other use of the switch
goes through too: a value other than 0 or 1 raises there, so no dispatch can be off where the rest is on.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any, ClassVar, Literal

import libcst as cst
from pydantic import Field

from toolkit.errors import ToolkitError
from toolkit.fields import ENV_PATTERN, CallableRef, Operation, PyExpr
from toolkit.transforms.base import Context, Kind, ModuleEdit, Sites, missing_scope, scope_or_none
from toolkit.transforms.cstutil import replace_nodes


class Dispatch(ModuleEdit):
    """Insert `if <switch on> [and <when>]: return injected(...)` at the top of a function."""

    kind: Literal["dispatch"]
    switch: str = Field(pattern=ENV_PATTERN, description="Environment variable that turns the fast path on")
    default: Literal["0", "1"] | None = Field(
        default=None, description="Value of the switch when it is unset; omitted: the default in the injected "
        "package's switches.json (the one table the package reads too)")
    target: CallableRef = Field(description="The injected callable, as module.path:function")
    args: list[PyExpr] | None = Field(
        default=None, description="Arguments passed to it (default: the function's own parameters, in order)"
    )
    when: PyExpr | None = Field(default=None, description="An extra condition, evaluated inside the function")
    fix: bool = Field(
        default=False, description="A fix the served code needs on the image (a kernel it lacks, an op it computes "
        "wrong, a state vLLM does not keep), not another implementation of the same math: the rehearsal's "
        "fast-paths-off reference keeps it on")
    operation: Operation | None = Field(
        default=None,
        description="The operation the injected path owns when switched on (e.g. moe.routed-experts); a variant "
        "that also switches on a prebuilt kernel of that operation (kind kernels) is a lint error")
    # what it says of the injected code, not the code written: a dispatch's digest (and marker) does not change with it
    provenance_fields: ClassVar[frozenset[str]] = ModuleEdit.provenance_fields | {"fix", "operation"}
    anchors_whole_scope: ClassVar[bool] = True  # the function it bypasses when switched on


SWITCH_TABLE = "switches.json"  # beside the injected package's __init__.py
SWITCH_READER = "switches"  # the module beside it that reads every switch of the table (`on` for a dispatch)


def forward_args(fn: cst.FunctionDef) -> list[str]:
    """The call arguments that pass a function's own parameters on unchanged."""
    p = fn.params
    out = [param.name.value for param in (*p.posonly_params, *p.params)]
    if isinstance(p.star_arg, cst.Param):
        out.append("*" + p.star_arg.name.value)
    out.extend(f"{param.name.value}={param.name.value}" for param in p.kwonly_params)
    if p.star_kwarg is not None:
        out.append("**" + p.star_kwarg.name.value)
    return out


def _body_start(fn: cst.FunctionDef) -> int:
    body = fn.body.body if isinstance(fn.body, cst.IndentedBlock) else []
    if body and isinstance(body[0], cst.SimpleStatementLine) and len(body[0].body) == 1:
        first = body[0].body[0]
        if isinstance(first, cst.Expr) and isinstance(first.value, cst.SimpleString | cst.ConcatenatedString):
            return 1  # after the docstring
    return 0


def load_switch_reader(folder: Path) -> tuple[Any, str | None]:
    """A patches package's switch reader (its switches.py, which checks its switches.json when imported), loaded
    from its file: the toolkit judges the table and the env with the code the server runs. (None, why) when it
    does not load, or lacks what the toolkit calls (an older copy)."""
    reader = folder / f"{SWITCH_READER}.py"
    stamp = tuple((f.stat().st_mtime_ns, f.stat().st_size) for f in (reader, folder / SWITCH_TABLE))
    return _load_switch_reader(str(reader), stamp)


@functools.lru_cache(maxsize=16)
def _load_switch_reader(reader: str, stamp: tuple[tuple[int, int], ...]) -> tuple[Any, str | None]:
    spec = importlib.util.spec_from_file_location(f"_toolkit_switches_{abs(hash((reader, stamp)))}", reader)
    if spec is None or spec.loader is None:
        return None, f"{reader} is not a Python module"
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the reader raises the same at the server's first read
        return None, f"{type(exc).__name__}: {exc}"
    missing = [f for f in ("TABLE", "problem", "allowed") if not hasattr(module, f)]
    if missing:
        return None, f"it has no {', '.join(missing)} (an older copy of the toolkit's reader?)"
    return module, None


class DispatchKind:
    def __init__(self, spec: Dispatch, ctx: Context) -> None:
        self.spec = spec
        self.module_name, _, self.func = spec.target.partition(":")
        self.alias = "_toolkit_" + spec.id.replace("-", "_").replace(".", "_")
        self.reader = f"{self.module_name.split('.')[0]}.{SWITCH_READER}"
        self._check_switch(ctx)

    def _check_switch(self, ctx: Context) -> None:
        """The switch is a flag of the injected package's switches.json, whose default the recipe may restate, never
        contradict; the package ships the table's reader too (the injected test calls it). The table is read
        through that reader, as the server reads it."""
        package = self.module_name.split(".")[0]
        folder = ctx.patches_dir / package
        table_file = folder / SWITCH_TABLE
        missing = next((f.name for f in (table_file, folder / f"{SWITCH_READER}.py") if not f.is_file()), None)
        if missing is not None:
            raise ToolkitError(
                f"transform {self.spec.id}: the dispatch's package {package} has no {missing} under "
                f"{ctx.patches_dir}: switch {self.spec.switch} must be read by the package's one strict reader",
                hint=f"ship {package}/{SWITCH_TABLE} (listing {self.spec.switch}: default, kind dispatch, type flag) "
                     f"and {package}/{SWITCH_READER}.py (copy the toolkit's patches/src/native_fastpaths/ pair)")
        reader, broken = load_switch_reader(folder)
        if reader is None:
            raise ToolkitError(f"transform {self.spec.id}: the switch reader of {package} does not load: {broken}",
                               hint=f"fix {table_file} or {folder / SWITCH_READER}.py")
        entry = reader.TABLE.get(self.spec.switch, {})
        listed = entry.get("default")
        if self.spec.default is not None and listed is not None and self.spec.default != listed:
            raise ToolkitError(
                f"transform {self.spec.id}: default {self.spec.default!r} for {self.spec.switch} contradicts "
                f"{table_file} ({listed!r})",
                hint="drop `default` from the recipe (the table decides) or change the table")
        if listed not in ("0", "1") or entry.get("type") != "flag":
            raise ToolkitError(
                f"transform {self.spec.id}: switch {self.spec.switch} is not a flag of {table_file}"
                + (f" (default {listed!r}, type {entry.get('type')!r}; a dispatch switch is a flag: 0 or 1)"
                   if entry else ""),
                hint=f"add {self.spec.switch} to {table_file} with default 0 or 1, kind dispatch, type flag")

    def _expected(self) -> str:
        return f"function {self.spec.scope} without a {self.spec.switch} dispatch to {self.spec.target}"

    def _is_ours(self, stmt: cst.CSTNode) -> bool:
        if not isinstance(stmt, cst.If) or not isinstance(stmt.body, cst.IndentedBlock):
            return False
        test = cst.Module(body=[]).code_for_node(stmt.test)
        if f'"{self.spec.switch}"' not in test and f"'{self.spec.switch}'" not in test:
            return False
        for line in stmt.body.body:
            if isinstance(line, cst.SimpleStatementLine):
                for small in line.body:
                    if isinstance(small, cst.ImportFrom) and small.module is not None:
                        module = cst.Module(body=[]).code_for_node(small.module)
                        names = [] if isinstance(small.names, cst.ImportStar) else [
                            a.name.value for a in small.names if isinstance(a.name, cst.Name)]
                        if module == self.module_name and self.func in names:
                            return True
        return False

    def count(self, module: cst.Module) -> Sites:
        fn = scope_or_none(module, self.spec)
        if fn is None:
            return missing_scope(module, self.spec, self._expected())
        if not isinstance(fn, cst.FunctionDef):
            return Sites(0, 0, f"{self.spec.scope} is a {type(fn).__name__}, not a function", self._expected(),
                         field="scope")
        body = fn.body.body if isinstance(fn.body, cst.IndentedBlock) else []
        post = sum(1 for stmt in body if self._is_ours(stmt))
        return Sites(
            0 if post else 1, post,
            f"function {self.spec.scope}" + (" with the dispatch" if post else " without the dispatch"),
            self._expected(),
        )

    def statement(self, fn: cst.FunctionDef) -> cst.BaseStatement:
        s = self.spec
        test = f'__import__("{self.reader}", fromlist=["on"]).on("{s.switch}")'
        if s.when:
            test = f"(\n    {test}\n    and ({' '.join(s.when.split())})\n)"
        args = ", ".join(s.args if s.args is not None else forward_args(fn))
        code = (
            f"if {test}:\n"
            f"    from {self.module_name} import {self.func} as {self.alias}\n"
            f"    return {self.alias}({args})\n"
        )
        return cst.parse_statement(code)

    def rewrite(self, module: cst.Module) -> cst.Module:
        fn = scope_or_none(module, self.spec)
        assert isinstance(fn, cst.FunctionDef) and isinstance(fn.body, cst.IndentedBlock)
        at = _body_start(fn)
        body = list(fn.body.body)
        body.insert(at, self.statement(fn))
        new_fn = fn.with_changes(body=fn.body.with_changes(body=body))
        return replace_nodes(module, {id(fn): lambda _: new_fn}, self.spec.scope)


KIND = Kind(Dispatch, DispatchKind)
