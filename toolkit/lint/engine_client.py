"""Which engine-client class vLLM's OpenAI server hands its endpoints, and what that class has, read from the patched
tree's source with libcst (vLLM is never imported).

vLLM 0.6.3's `build_async_engine_client_from_engine_args` gives the endpoints an `AsyncLLMEngine` when
`--disable-frontend-multiprocessing` is passed or `MQLLMEngineClient.is_unsupported_config(engine_args)` holds, and
an `MQLLMEngineClient` (the multiprocessing front end) otherwise; the two do not have the same methods
(`get_scheduler_config` is only on the first). A deployed endpoint that calls what the selected class lacks answers
every request with HTTP 500.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

CLIENT_FILE = "vllm/engine/multiprocessing/client.py"
CLIENT_CLASS = "MQLLMEngineClient"
ENGINE_FILE = "vllm/engine/async_llm_engine.py"
ENGINE_CLASS = "AsyncLLMEngine"
FRONTEND_FLAG = "disable-frontend-multiprocessing"
ENDPOINTS = "vllm/entrypoints/"
RECEIVERS = ("engine_client",)  # `self.engine_client.X` and a local `engine_client.X`


@dataclass(frozen=True)
class Call:
    name: str
    line: int


class _Uses(cst.CSTVisitor):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def visit_Attribute(self, node: cst.Attribute) -> None:
        receiver = node.value
        named = (isinstance(receiver, cst.Attribute) and isinstance(receiver.value, cst.Name)
                 and receiver.value.value == "self" and receiver.attr.value in RECEIVERS) or (
            isinstance(receiver, cst.Name) and receiver.value in RECEIVERS)
        if named:
            line = self.get_metadata(PositionProvider, node).start.line
            self.calls.append(Call(node.attr.value, line))


@functools.lru_cache(maxsize=64)
def client_uses(text: str) -> tuple[Call, ...]:
    """Every attribute an endpoint module reads off its engine client, with its line (none if it does not parse)."""
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError:
        return ()
    uses = _Uses()
    MetadataWrapper(module).visit(uses)
    return tuple(uses.calls)


def _class(module: cst.Module, name: str) -> cst.ClassDef | None:
    return next((s for s in module.body if isinstance(s, cst.ClassDef) and s.name.value == name), None)


class _SelfAssigned(cst.CSTVisitor):
    def __init__(self) -> None:
        self.names: set[str] = set()

    def _target(self, target: cst.BaseExpression) -> None:
        if isinstance(target, cst.Attribute) and isinstance(target.value, cst.Name) and target.value.value == "self":
            self.names.add(target.attr.value)

    def visit_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:
            self._target(t.target)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._target(node.target)


@functools.lru_cache(maxsize=16)
def class_members(text: str, name: str) -> frozenset[str] | None:
    """What instances of class `name` have: its methods and properties, class attributes, what its methods assign
    to `self`, and the same of a base class defined in the module. None: the class is not in the text, or a base
    comes from elsewhere (it may have anything)."""
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError:
        return None
    cls = _class(module, name)
    if cls is None:
        return None
    body = cls.body.body if isinstance(cls.body, cst.IndentedBlock) else ()
    if any(isinstance(s, cst.FunctionDef) and s.name.value == "__getattr__" for s in body):
        return None  # it answers any name
    members: set[str] = set()
    for base in cls.bases:
        value = base.value
        if isinstance(value, cst.Name) and value.value in ("object", "Protocol"):
            continue
        inherited = class_members(text, value.value) if isinstance(value, cst.Name) else None
        if inherited is None:
            return None
        members |= inherited
    for stmt in body:
        if isinstance(stmt, cst.FunctionDef):
            members.add(stmt.name.value)
        elif isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                targets = ([t.target for t in small.targets] if isinstance(small, cst.Assign) else
                           [small.target] if isinstance(small, cst.AnnAssign) else [])
                members.update(t.value for t in targets if isinstance(t, cst.Name))
    assigned = _SelfAssigned()
    cls.visit(assigned)
    return frozenset(members | assigned.names)


def _static_return(text: str, cls: str, method: str) -> ast.expr | None:
    """The expression a one-statement method of a class returns (`return engine_args.x > 1`), read with ast."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    body = [s for s in item.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
                    if len(body) == 1 and isinstance(body[0], ast.Return) and body[0].value is not None:
                        return body[0].value
    return None


def unsupported_config(text: str, arg: Callable[[str], object]) -> bool | None:
    """What `MQLLMEngineClient.is_unsupported_config(engine_args)` returns for these args (arg: an engine arg's
    value by its field name), when it is a comparison of engine args with constants; None: not readable so."""
    expr = _static_return(text, CLIENT_CLASS, "is_unsupported_config")
    if expr is None:
        return None

    def value(node: ast.expr) -> object:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "engine_args":
            return arg(node.attr)
        if isinstance(node, ast.BoolOp):
            parts = [value(v) for v in node.values]
            return all(parts) if isinstance(node.op, ast.And) else any(parts)
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            left, right = value(node.left), value(node.comparators[0])
            ops: dict[type, Callable[[object, object], bool]] = {
                ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,  # type: ignore[operator]
                ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b,  # type: ignore[operator]
                ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b}
            if type(node.ops[0]) in ops:
                return ops[type(node.ops[0])](left, right)
        raise ValueError(ast.dump(node))

    try:
        return bool(value(expr))
    except (ValueError, TypeError):
        return None


@functools.lru_cache(maxsize=16)
def engine_arg_defaults(text: str) -> dict[str, object]:
    """`EngineArgs`' field defaults that are constants (arg_utils.py), by field name."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "EngineArgs":
            return {s.target.id: s.value.value for s in node.body if isinstance(s, ast.AnnAssign)
                    and isinstance(s.target, ast.Name) and isinstance(s.value, ast.Constant)}
    return {}


def missing(uses: tuple[Call, ...], members: frozenset[str]) -> Iterator[Call]:
    """Each use of a name the class lacks, once per name and line."""
    seen: set[tuple[str, int]] = set()
    for call in uses:
        if call.name not in members and (call.name, call.line) not in seen:
            seen.add((call.name, call.line))
            yield call
