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


@functools.lru_cache(maxsize=512)
def module_code(module: cst.Module) -> str:
    """A module's source, generated once per module object: libcst nodes are immutable and hashed by identity, and
    one file's transforms hand each other their modules (one step's after is the next one's before), so a diff or
    an upgrade's comparison asked the same module for its code twice or more (the flagship's `toolkit diff` spent
    most of its time there)."""
    return module.code


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


def walk_statements(scope: cst.CSTNode) -> Iterator[tuple[cst.BaseSmallStatement, list[cst.CSTNode]]]:
    """Every small statement in a scope with its ancestors, without entering expressions or nested defs.

    Much cheaper than a visitor on large modules: only statement-level nodes are touched.
    """

    def blocks(node: cst.CSTNode) -> list[cst.CSTNode]:
        if isinstance(node, cst.Module | cst.IndentedBlock | cst.SimpleStatementSuite):
            return [node]
        out: list[cst.CSTNode] = []
        for name in ("body", "orelse", "finalbody"):
            child = getattr(node, name, None)
            if isinstance(child, cst.CSTNode):
                out.extend(blocks(child))
        for handler in getattr(node, "handlers", ()):
            out.extend(blocks(handler))
        return out

    def walk(block: cst.CSTNode, path: list[cst.CSTNode]) -> Iterator[tuple[cst.BaseSmallStatement, list[cst.CSTNode]]]:
        for stmt in getattr(block, "body", ()):
            here = [*path, block, stmt]
            if isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    yield small, here
            elif isinstance(stmt, cst.BaseSmallStatement):  # inside a SimpleStatementSuite
                yield stmt, [*path, block]
            elif not isinstance(stmt, cst.FunctionDef | cst.ClassDef):
                for inner in blocks(stmt):
                    yield from walk(inner, here)

    start = scope.body if isinstance(scope, cst.FunctionDef | cst.ClassDef) else scope
    prefix: list[cst.CSTNode] = [scope] if start is not scope else []
    yield from walk(start, prefix)


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


_BLOCKS = (cst.Module, cst.IndentedBlock, cst.If, cst.Else, cst.Try, cst.TryStar, cst.ExceptHandler,
           cst.ExceptStarHandler, cst.Finally, cst.With)


class _Ancestors(cst.CSTVisitor):
    """Collects the nodes on the way from the scope down to each target."""

    def __init__(self, targets: set[int]) -> None:
        self.targets = targets
        self.stack: list[int] = []
        self.keep: set[int] = set()

    def on_visit(self, node: cst.CSTNode) -> bool:
        self.stack.append(id(node))
        if id(node) in self.targets:
            self.keep.update(self.stack)
        return True

    def on_leave(self, original_node: cst.CSTNode) -> None:
        self.stack.pop()


class ReplaceNodes(cst.CSTTransformer):
    """Replace exactly the given original nodes (by identity), rebuilding only their ancestors.

    Outside the scope only block statements and the defs on the scope's path are entered;
    inside it only the targets' ancestors. A full-module transform costs ~100 ms on a large
    vLLM file; this touches a few hundred nodes.
    """

    def __init__(
        self, targets: dict[int, Callable[[cst.CSTNode], cst.CSTNode | cst.RemovalSentinel]],
        keep: set[int], chain: set[int], scope: int,
    ) -> None:
        super().__init__()
        self.targets = targets
        self.keep = keep
        self.chain = chain
        self.scope = scope
        self.inside = False
        self.hits = 0

    def on_visit(self, node: cst.CSTNode) -> bool:
        if id(node) == self.scope:
            self.inside = True
        if id(node) in self.keep or id(node) in self.chain:
            return True
        if self.inside or isinstance(node, cst.FunctionDef | cst.ClassDef | cst.SimpleStatementLine):
            return False
        return isinstance(node, _BLOCKS)

    def on_leave(  # type: ignore[override]
        self, original_node: cst.CSTNode, updated_node: cst.CSTNode
    ) -> cst.CSTNode | cst.RemovalSentinel:
        if id(original_node) == self.scope:
            self.inside = False
        fn = self.targets.get(id(original_node))
        if fn is None:
            return updated_node
        self.hits += 1
        return fn(updated_node)


def scope_chain(module: cst.Module, scope: str) -> list[cst.CSTNode]:
    """The module and every class/def on the way to a dotted scope."""
    names = qualnames(module)
    parts = scope.split(".") if scope else []
    return [module, *(names[".".join(parts[: i + 1])] for i in range(len(parts)))]


def replace_nodes(
    module: cst.Module,
    targets: dict[int, Callable[[cst.CSTNode], cst.CSTNode | cst.RemovalSentinel]],
    scope: str = "",
    ancestors: set[int] | None = None,
) -> cst.Module:
    """ancestors: the ids of the targets' ancestors inside the scope, when the caller already knows them."""
    chain = scope_chain(module, scope)
    if ancestors is None:
        finder = _Ancestors(set(targets))
        chain[-1].visit(finder)
        ancestors = finder.keep
    transformer = ReplaceNodes(targets, ancestors | set(targets), {id(n) for n in chain}, id(chain[-1]))
    new = module.visit(transformer)
    if transformer.hits != len(targets):
        raise AssertionError(f"replaced {transformer.hits} of {len(targets)} nodes")
    return new
