"""libcst helpers shared by the transform kinds: scopes, structural equality, node replacement."""

from __future__ import annotations

import ast
import difflib
import functools
from collections.abc import Callable, Iterator, Sequence

import libcst as cst

ScopeNode = cst.Module | cst.FunctionDef | cst.ClassDef

_EMPTY = cst.Module(body=[])


def code_of(node: cst.CSTNode) -> str:
    return _EMPTY.code_for_node(node)


@functools.lru_cache(maxsize=4096)
def _canonical_expr(code: str) -> str:
    # Parenthesised on their own lines so multi-line and commented expressions parse too.
    return ast.dump(ast.parse(f"(\n{code}\n)", mode="eval").body)


def canonical(node_or_code: cst.CSTNode | str) -> str:
    """A formatting-independent form of an expression (ast dump)."""
    code = node_or_code if isinstance(node_or_code, str) else code_of(node_or_code)
    return _canonical_expr(code.strip())


def same_expr(node: cst.CSTNode, code: str) -> bool:
    try:
        return canonical(node) == canonical(code)
    except SyntaxError:
        return False


def canonical_block(statements: Sequence[cst.BaseStatement]) -> str:
    body = [s for s in statements if isinstance(s, cst.SimpleStatementLine | cst.BaseCompoundStatement)]
    return ast.dump(ast.parse(cst.Module(body=body).code))


def dotted_name(node: cst.BaseExpression) -> str | None:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted_name(node.value)
        return f"{base}.{node.attr.value}" if base else None
    return None


def qualnames(module: cst.Module) -> dict[str, cst.FunctionDef | cst.ClassDef]:
    """Every class and function in a module by dotted qualified name."""
    found: dict[str, cst.FunctionDef | cst.ClassDef] = {}

    def visit(body: object, prefix: str) -> None:
        for stmt in _statements(body):
            if isinstance(stmt, cst.FunctionDef | cst.ClassDef):
                name = f"{prefix}{stmt.name.value}"
                found.setdefault(name, stmt)
                visit(stmt.body, name + ".")
            elif isinstance(stmt, cst.If | cst.Try | cst.With):
                # definitions guarded by `if TYPE_CHECKING`/try-import keep their plain names
                visit(stmt.body, prefix)
                for extra in _branches(stmt):
                    visit(extra, prefix)

    visit(module, "")
    return found


def _statements(body: object) -> list[cst.BaseStatement]:
    if isinstance(body, cst.Module):
        return list(body.body)
    if isinstance(body, cst.IndentedBlock):
        return [s for s in body.body if isinstance(s, cst.BaseStatement)]
    return []


def _branches(stmt: cst.If | cst.Try | cst.With) -> Iterator[object]:
    if isinstance(stmt, cst.If):
        orelse = stmt.orelse
        while isinstance(orelse, cst.If):
            yield orelse.body
            orelse = orelse.orelse
        if isinstance(orelse, cst.Else):
            yield orelse.body
    elif isinstance(stmt, cst.Try):
        for handler in stmt.handlers:
            yield handler.body
        if stmt.orelse:
            yield stmt.orelse.body
        if stmt.finalbody:
            yield stmt.finalbody.body


def resolve_scope(module: cst.Module, scope: str) -> ScopeNode | None:
    if not scope:
        return module
    return qualnames(module).get(scope)


def nearest_names(module: cst.Module, scope: str, limit: int = 5) -> list[str]:
    names = list(qualnames(module))
    close = difflib.get_close_matches(scope, names, n=limit, cutoff=0.5)
    tail = scope.rsplit(".", 1)[-1]
    same_tail = [n for n in names if n.rsplit(".", 1)[-1] == tail and n not in close]
    return (same_tail + close)[:limit]


class _ScopeWalker(cst.CSTVisitor):
    def __init__(self, root: cst.CSTNode) -> None:
        self.root = root
        self.nodes: list[cst.CSTNode] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        self.nodes.append(node)
        # nested classes and functions are scopes of their own, addressed by their own qualified name
        return node is self.root or not isinstance(node, cst.FunctionDef | cst.ClassDef | cst.Lambda)


def walk_scope(scope: cst.CSTNode) -> list[cst.CSTNode]:
    walker = _ScopeWalker(scope)
    scope.visit(walker)
    return walker.nodes


class ReplaceNodes(cst.CSTTransformer):
    """Replace exactly the given original nodes (by identity)."""

    def __init__(
        self, targets: dict[int, Callable[[cst.CSTNode], cst.CSTNode | cst.RemovalSentinel]]
    ) -> None:
        super().__init__()
        self.targets = targets
        self.hits = 0

    def on_leave(  # type: ignore[override]
        self, original_node: cst.CSTNode, updated_node: cst.CSTNode
    ) -> cst.CSTNode | cst.RemovalSentinel:
        fn = self.targets.get(id(original_node))
        if fn is None:
            return updated_node
        self.hits += 1
        return fn(updated_node)


def replace_nodes(
    module: cst.Module, targets: dict[int, Callable[[cst.CSTNode], cst.CSTNode | cst.RemovalSentinel]]
) -> cst.Module:
    transformer = ReplaceNodes(targets)
    new = module.visit(transformer)
    if transformer.hits != len(targets):
        raise AssertionError(f"replaced {transformer.hits} of {len(targets)} nodes")
    return new
