"""statements: replace a run of statements inside a scope, or insert statements after one or at its top.

For the edits the other kinds cannot say: a `pass` that becomes an assignment in one branch, a block that gains an
early return, a guard at the top of a function, an import inside `if TYPE_CHECKING:`. Statements are compared
structurally (formatting and comments do not matter); the run must be found exactly `expect` times in the scope.
"""

from __future__ import annotations

import ast
import functools
import textwrap
from collections.abc import Iterator, Sequence
from typing import Literal

import libcst as cst
from pydantic import Field, model_validator

from toolkit.fields import PyBlock
from toolkit.transforms.base import Context, Kind, ModuleEdit, Sites, missing_scope, scope_or_none
from toolkit.transforms.cstutil import replace_nodes

Suite = cst.Module | cst.IndentedBlock


class Statements(ModuleEdit):
    """Replace a run of statements in a scope (`old`), insert after one (`after`), or insert at the scope's top."""

    kind: Literal["statements"]
    old: PyBlock | None = Field(default=None, description="The consecutive statements to replace")
    after: PyBlock | None = Field(default=None, description="The statement(s) to insert `new` after")
    new: PyBlock = Field(description="The statements written instead of `old`, after `after`, or at the top")

    @model_validator(mode="after")
    def _one_place(self) -> Statements:
        if self.old is not None and self.after is not None:
            raise ValueError("give `old` (replace) or `after` (insert after), not both")
        if self.old is None and self.after is None and not self.scope:
            raise ValueError("inserting at the top needs a function or class `scope`")
        return self


# libcst nodes are immutable, compared and hashed by identity, and a rewrite keeps every node it does not touch: a
# statement's form is computed once, not once per transform of its file and again after each rewrite (a scope's
# whole classes were printed and parsed again for every statement transform of a module). The cache holds its
# nodes, so an identity is never reused while its entry lives.
@functools.lru_cache(maxsize=4096)  # about two flagship plans' statements
def _key(statement: cst.BaseStatement) -> str:
    """A formatting-independent form of one statement (`a; b` on one line is one statement here)."""
    code = cst.Module(body=[statement]).code  # type: ignore[list-item]
    return "\n".join(ast.dump(node) for node in ast.parse(code).body)


def canonical_statements(statements: Sequence[cst.BaseStatement]) -> tuple[str, ...]:
    return tuple(_key(s) for s in statements)


@functools.lru_cache(maxsize=256)
def _canonical_text(text: str) -> tuple[str, ...]:
    return canonical_statements(parse_block(text))


def parse_block(text: str) -> list[cst.BaseStatement]:
    return list(cst.parse_module(textwrap.dedent(text).strip("\n") + "\n").body)


def suites(scope: cst.CSTNode) -> Iterator[Suite]:
    """Every statement list in a scope, nested blocks included, nested defs and classes excluded."""

    def inner(node: cst.CSTNode) -> Iterator[Suite]:
        for name in ("body", "orelse", "finalbody"):
            child = getattr(node, name, None)
            if isinstance(child, cst.IndentedBlock):
                yield from walk(child)
            elif isinstance(child, cst.CSTNode):
                yield from inner(child)
        for handler in getattr(node, "handlers", ()):
            yield from inner(handler)

    def walk(suite: Suite) -> Iterator[Suite]:
        yield suite
        for stmt in suite.body:
            if isinstance(stmt, cst.BaseCompoundStatement) and not isinstance(stmt, cst.FunctionDef | cst.ClassDef):
                yield from inner(stmt)

    if isinstance(scope, cst.Module):
        yield from walk(scope)
    elif isinstance(scope, cst.FunctionDef | cst.ClassDef) and isinstance(scope.body, cst.IndentedBlock):
        yield from walk(scope.body)


def docstring_end(suite: Suite) -> int:
    first = suite.body[0] if suite.body else None
    if (isinstance(first, cst.SimpleStatementLine) and len(first.body) == 1 and isinstance(first.body[0], cst.Expr)
            and isinstance(first.body[0].value, cst.SimpleString | cst.ConcatenatedString)):
        return 1
    return 0


class StatementsKind:
    def __init__(self, spec: Statements, ctx: Context) -> None:
        self.spec = spec
        self.new = _canonical_text(spec.new)
        self.old = _canonical_text(spec.old) if spec.old is not None else None
        self.after = _canonical_text(spec.after) if spec.after is not None else None

    def _expected(self) -> str:
        s = self.spec
        if s.old is not None:
            return f"{len(self.old or ())} statement(s) `{_short(s.old)}` -> `{_short(s.new)}`"
        if s.after is not None:
            return f"`{_short(s.new)}` after `{_short(s.after)}`"
        return f"`{_short(s.new)}` at the top of {s.scope or 'the module'}"

    def _sites(self, scope: cst.CSTNode) -> list[tuple[Suite, int, bool]]:
        """(suite, index, is_post) for each site: the run to replace, or the place to insert at."""
        out: list[tuple[Suite, int, bool]] = []
        if self.old is None and self.after is None:
            suite = next(suites(scope), None)
            if suite is None:
                return out
            start = docstring_end(suite)
            present = canonical_statements(suite.body[start:start + len(self.new)]) == self.new
            return [(suite, start, present)]
        for suite in suites(scope):
            canon = canonical_statements(suite.body)
            for i in range(len(canon)):
                if self.old is not None:
                    if tuple(canon[i:i + len(self.old)]) == self.old:
                        out.append((suite, i, False))
                    elif tuple(canon[i:i + len(self.new)]) == self.new:
                        out.append((suite, i, True))
                elif self.after is not None and tuple(canon[i:i + len(self.after)]) == self.after:
                    end = i + len(self.after)
                    out.append((suite, end, tuple(canon[end:end + len(self.new)]) == self.new))
        return out

    def count(self, module: cst.Module) -> Sites:
        scope = scope_or_none(module, self.spec)
        if scope is None:
            return missing_scope(module, self.spec, self._expected())
        sites = self._sites(scope)
        pre = sum(1 for *_, post in sites if not post)
        post = sum(1 for *_, post in sites if post)
        found = f"{pre} site(s) in the pre-state, {post} in the post-state"
        at = "old" if self.spec.old is not None else "after" if self.spec.after is not None else "scope"
        return Sites(pre, post, found, self._expected(), field=at)

    def rewrite(self, module: cst.Module) -> cst.Module:
        scope = scope_or_none(module, self.spec)
        assert scope is not None
        by_suite: dict[int, list[int]] = {}
        for suite, index, post in self._sites(scope):
            if not post:
                by_suite.setdefault(id(suite), []).append(index)
        drop = len(self.old) if self.old is not None else 0

        def edit(node: cst.CSTNode, indexes: list[int]) -> cst.CSTNode:
            assert isinstance(node, cst.Module | cst.IndentedBlock)
            body = list(node.body)
            for index in sorted(indexes, reverse=True):
                replaced = body[index:index + drop]
                new = parse_block(self.spec.new)
                first = replaced[0] if replaced else None
                if isinstance(first, cst.SimpleStatementLine | cst.BaseCompoundStatement):
                    # the replaced run's leading comments and blank lines stay with the new run
                    new[0] = new[0].with_changes(leading_lines=first.leading_lines)
                body[index:index + drop] = new
            return node.with_changes(body=body)

        targets = {key: (lambda n, ix=ix: edit(n, ix)) for key, ix in by_suite.items()}
        return replace_nodes(module, targets, self.spec.scope)  # type: ignore[arg-type]


def _short(text: str) -> str:
    flat = " ".join(textwrap.dedent(text).split())
    return flat if len(flat) <= 70 else flat[:67] + "..."


KIND = Kind(Statements, StatementsKind)
