"""dict-entries: insert string-keyed entries into a mapping literal bound to a name.

The literal is a dict display, or a call over a list of (key, value) pairs, as transformers writes its auto
mappings (`OrderedDict[str, str]([("qwen3", "Qwen3Config"), ...])`).
"""

from __future__ import annotations

import ast
import json
from typing import Literal

import libcst as cst
from pydantic import Field

from toolkit.fields import Identifier, PyExpr
from toolkit.transforms.base import Context, Kind, ModuleEdit, Sites, missing_scope, scope_or_none
from toolkit.transforms.cstutil import code_of, replace_nodes, same_expr, walk_statements

Container = cst.Dict | cst.List


class DictEntries(ModuleEdit):
    """Insert entries into a dict literal bound to a name."""

    kind: Literal["dict-entries"]
    name: Identifier = Field(description="The name the dict literal is assigned to")
    entries: dict[str, PyExpr] = Field(min_length=1, description="String key -> value expression")
    after: str | None = Field(default=None, description="Insert after this existing key (default: at the end)")


def _pair(element: cst.CSTNode) -> tuple[cst.BaseExpression, cst.BaseExpression] | None:
    if isinstance(element, cst.DictElement):
        return element.key, element.value
    if isinstance(element, cst.Element) and isinstance(element.value, cst.Tuple) and len(element.value.elements) == 2:
        first, second = element.value.elements
        return first.value, second.value
    return None


def _key(element: cst.CSTNode) -> str | None:
    pair = _pair(element)
    if pair is None:
        return None
    try:
        value = ast.literal_eval(code_of(pair[0]).strip())
    except (ValueError, SyntaxError):
        return None
    return value if isinstance(value, str) else None


def _value(element: cst.CSTNode) -> cst.BaseExpression | None:
    pair = _pair(element)
    return pair[1] if pair else None


def _container(value: cst.BaseExpression | None) -> Container | None:
    """The dict display, or the list of pairs a mapping call is made from."""
    if isinstance(value, cst.Dict):
        return value
    if isinstance(value, cst.Call) and len(value.args) == 1 and value.args[0].keyword is None:
        items = value.args[0].value
        if isinstance(items, cst.List) and all(_pair(e) is not None for e in items.elements):
            return items
    return None


class DictEntriesKind:
    def __init__(self, spec: DictEntries, ctx: Context) -> None:
        self.spec = spec

    def _expected(self) -> str:
        where = f" after {self.spec.after!r}" if self.spec.after else ""
        return f"dict literal `{self.spec.name}` without keys {sorted(self.spec.entries)}{where}"

    def _dicts(self, scope: cst.CSTNode) -> list[Container]:
        return [d for d, _ in self._sites(scope)]

    def _sites(self, scope: cst.CSTNode) -> list[tuple[Container, list[cst.CSTNode]]]:
        found = []
        for node, path in walk_statements(scope):
            if isinstance(node, cst.Assign):
                names = [t.target for t in node.targets]
            elif isinstance(node, cst.AnnAssign):
                names = [node.target]
            else:
                continue
            container = _container(node.value)
            if container is None:
                continue
            if any(isinstance(n, cst.Name) and n.value == self.spec.name for n in names):
                extra: list[cst.CSTNode] = [node.value, node.value.args[0]] if isinstance(node.value, cst.Call) else []
                found.append((container, [*path, node, *extra]))
        return found

    def _at_fault(self, dicts: list[Container]) -> str:
        """`after` when a mapping lacks the key to insert after, else `entries`."""
        missing = self.spec.after is not None and any(
            self.spec.after not in {_key(e) for e in d.elements} for d in dicts)
        return "after" if missing else "entries"

    def _classify(self, d: Container) -> tuple[bool, bool, str]:
        present = {k: e for e in d.elements if (k := _key(e)) is not None}
        ours = {k: present[k] for k in self.spec.entries if k in present}
        matching = [k for k, e in ours.items() if (v := _value(e)) is not None
                    and same_expr(v, self.spec.entries[k])]
        anchor_ok = self.spec.after is None or self.spec.after in present
        is_pre = not ours and anchor_ok
        is_post = len(matching) == len(self.spec.entries)
        notes = [f"{len(present)} keys"]
        if ours:
            notes.append("has " + ", ".join(
                f"{k!r}: {code_of(v).strip()}" for k, e in ours.items() if (v := _value(e)) is not None))
        if not anchor_ok:
            notes.append(f"no key {self.spec.after!r} to insert after")
        return is_pre, is_post, "; ".join(notes)

    def count(self, module: cst.Module) -> Sites:
        scope = scope_or_none(module, self.spec)
        if scope is None:
            return missing_scope(module, self.spec, self._expected())
        dicts = self._dicts(scope)
        if not dicts:
            return Sites(0, 0, f"no dict literal assigned to {self.spec.name!r}", self._expected(), field="name")
        pre = post = 0
        notes = []
        for d in dicts:
            is_pre, is_post, note = self._classify(d)
            pre += is_pre
            post += is_post
            notes.append(note)
        found = f"{len(dicts)} dict(s) named {self.spec.name}: " + " | ".join(notes)
        if pre + post != len(dicts):
            # a dict holding some of our keys, or other values for them, is a changed vendor: drift
            return Sites(0, 0, found, self._expected(), field=self._at_fault(dicts))
        return Sites(pre, post, found, self._expected(), field=self._at_fault(dicts))

    def _insert(self, d: Container) -> Container:
        elements = list(d.elements)
        keys = [_key(e) for e in elements]
        index = keys.index(self.spec.after) if self.spec.after else len(elements) - 1
        at_end = index == len(elements) - 1
        # the separator between entries carries the layout (newline + indent) of this dict
        separators = [e.comma for e in elements[:-1] if isinstance(e.comma, cst.Comma)]
        sep = separators[min(index, len(separators) - 1)] if separators else cst.Comma(
            whitespace_after=cst.SimpleWhitespace(" "))
        new: list[cst.Element | cst.DictElement] = [
            cst.DictElement(cst.SimpleString(json.dumps(k)), cst.parse_expression(v), comma=sep)
            if isinstance(d, cst.Dict) else
            cst.Element(cst.Tuple([cst.Element(cst.SimpleString(json.dumps(k)), comma=cst.Comma(
                whitespace_after=cst.SimpleWhitespace(" "))), cst.Element(cst.parse_expression(v))]), comma=sep)
            for k, v in self.spec.entries.items()
        ]
        if at_end:
            # the old last entry's comma (trailing or none) moves to the new last entry
            trailing = elements[-1].comma if elements else cst.MaybeSentinel.DEFAULT
            new[-1] = new[-1].with_changes(comma=trailing)
            if elements:
                elements[-1] = elements[-1].with_changes(comma=sep)
        return d.with_changes(elements=[*elements[: index + 1], *new, *elements[index + 1:]])

    def rewrite(self, module: cst.Module) -> cst.Module:
        scope = scope_or_none(module, self.spec)
        assert scope is not None
        sites = [(d, path) for d, path in self._sites(scope) if self._classify(d)[0]]
        targets = {id(d): self._insert for d, _ in sites}
        ancestors = {id(n) for _, path in sites for n in path}
        return replace_nodes(module, targets, self.spec.scope, ancestors)  # type: ignore[arg-type]


KIND = Kind(DictEntries, DictEntriesKind)
