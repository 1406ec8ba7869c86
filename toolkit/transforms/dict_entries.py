"""dict-entries: insert string-keyed entries into a dict literal bound to a name."""

from __future__ import annotations

import ast
import json

import libcst as cst

from toolkit.recipe import DictEntries
from toolkit.transforms.base import Context, Probe, missing_scope, scope_or_none
from toolkit.transforms.cstutil import code_of, replace_nodes, same_expr, walk_statements


def _key(element: cst.BaseDictElement) -> str | None:
    if not isinstance(element, cst.DictElement):
        return None
    try:
        value = ast.literal_eval(code_of(element.key).strip())
    except (ValueError, SyntaxError):
        return None
    return value if isinstance(value, str) else None


class DictEntriesKind:
    def __init__(self, spec: DictEntries, ctx: Context) -> None:
        self.spec = spec

    def _expected(self) -> str:
        where = f" after {self.spec.after!r}" if self.spec.after else ""
        return f"dict literal `{self.spec.name}` without keys {sorted(self.spec.entries)}{where}"

    def _dicts(self, scope: cst.CSTNode) -> list[cst.Dict]:
        return [d for d, _ in self._sites(scope)]

    def _sites(self, scope: cst.CSTNode) -> list[tuple[cst.Dict, list[cst.CSTNode]]]:
        found = []
        for node, path in walk_statements(scope):
            if isinstance(node, cst.Assign) and isinstance(node.value, cst.Dict):
                names = [t.target for t in node.targets]
            elif isinstance(node, cst.AnnAssign) and isinstance(node.value, cst.Dict):
                names = [node.target]
            else:
                continue
            if any(isinstance(n, cst.Name) and n.value == self.spec.name for n in names):
                found.append((node.value, [*path, node]))
        return found

    def _classify(self, d: cst.Dict) -> tuple[bool, bool, str]:
        present = {k: e for e in d.elements if (k := _key(e)) is not None}
        ours = {k: present[k] for k in self.spec.entries if k in present}
        matching = [k for k, e in ours.items() if isinstance(e, cst.DictElement)
                    and same_expr(e.value, self.spec.entries[k])]
        anchor_ok = self.spec.after is None or self.spec.after in present
        is_pre = not ours and anchor_ok
        is_post = len(matching) == len(self.spec.entries)
        notes = [f"{len(present)} keys"]
        if ours:
            notes.append("has " + ", ".join(
                f"{k!r}: {code_of(e.value).strip()}" for k, e in ours.items() if isinstance(e, cst.DictElement)))
        if not anchor_ok:
            notes.append(f"no key {self.spec.after!r} to insert after")
        return is_pre, is_post, "; ".join(notes)

    def probe(self, module: cst.Module) -> Probe:
        scope = scope_or_none(module, self.spec)
        if scope is None:
            return missing_scope(module, self.spec, self._expected())
        dicts = self._dicts(scope)
        if not dicts:
            return Probe(0, 0, f"no dict literal assigned to {self.spec.name!r}", self._expected())
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
            return Probe(0, 0, found, self._expected())
        return Probe(pre, post, found, self._expected())

    def _insert(self, d: cst.Dict) -> cst.Dict:
        elements = list(d.elements)
        keys = [_key(e) for e in elements]
        index = keys.index(self.spec.after) if self.spec.after else len(elements) - 1
        at_end = index == len(elements) - 1
        # the separator between entries carries the layout (newline + indent) of this dict
        separators = [e.comma for e in elements[:-1] if isinstance(e.comma, cst.Comma)]
        sep = separators[min(index, len(separators) - 1)] if separators else cst.Comma(
            whitespace_after=cst.SimpleWhitespace(" "))
        new = [
            cst.DictElement(cst.SimpleString(json.dumps(k)), cst.parse_expression(v), comma=sep)
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
