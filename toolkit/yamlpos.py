"""YAML loading that remembers where every value came from.

pydantic reports errors by location tuples; we keep a map from those tuples to
the (line, column) of the YAML node so that every recipe error names file:line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

Path_ = tuple[str | int, ...]


@dataclass(frozen=True)
class Mark:
    line: int  # 1-based
    column: int  # 1-based
    file: str = ""  # the file the node was read from (a recipe's layers are several files)


class YamlLoadError(Exception):
    def __init__(self, message: str, mark: Mark | None) -> None:
        super().__init__(message)
        self.message = message
        self.mark = mark


@dataclass
class Located:
    data: Any
    marks: dict[Path_, Mark]
    key_marks: dict[Path_, Mark]  # where the key itself stands (for unknown keys)

    def mark_for(self, path: Path_) -> Mark | None:
        """The nearest known position for a pydantic location."""
        path = tuple(path)
        while path:
            if path in self.key_marks:
                return self.key_marks[path]
            if path in self.marks:
                return self.marks[path]
            path = path[:-1]
        return self.marks.get(())


def _mark(node: yaml.Node, file: str = "") -> Mark:
    return Mark(node.start_mark.line + 1, node.start_mark.column + 1, file)


def _load_error(exc: yaml.YAMLError, text: str) -> YamlLoadError:
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = Mark(mark.line + 1, mark.column + 1) if mark else None
        return YamlLoadError(f"invalid YAML: {exc.problem or exc}", where)
    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML does not allow, e.g. a control character
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        code = exc.character if isinstance(exc.character, int) else ord(exc.character[:1] or "\0")
        return YamlLoadError(f"invalid YAML: character U+{code:04X} is not allowed in YAML ({exc.reason})",
                             Mark(line, column))
    return YamlLoadError(f"invalid YAML: {exc}", None)


# libyaml composes the nodes (with their marks) about ten times faster than PyYAML's Python parser, which was half
# of every verb's recipe load; PyYAML's own parser reads a document libyaml refuses, so a refusal reads as before
_COMPOSER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _compose(text: str) -> yaml.Node | None:
    try:
        return yaml.compose(text, Loader=_COMPOSER)
    except yaml.YAMLError:
        if _COMPOSER is yaml.SafeLoader:
            raise
    return yaml.compose(text, Loader=yaml.SafeLoader)


def load(text: str, file: str = "") -> Located:
    try:
        root = _compose(text)
    except yaml.YAMLError as exc:
        raise _load_error(exc, text) from exc
    marks: dict[Path_, Mark] = {}
    key_marks: dict[Path_, Mark] = {}
    if root is None:
        return Located({}, marks, key_marks)
    constructor = yaml.SafeLoader(text)  # only used to resolve scalars to Python values

    def build(node: yaml.Node, path: Path_) -> Any:
        marks[path] = _mark(node, file)
        if isinstance(node, yaml.MappingNode):
            out: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    raise YamlLoadError("YAML merge keys (<<) are not supported in recipes", _mark(key_node))
                key = constructor.construct_object(key_node, deep=True)
                if not isinstance(key, str | int):
                    raise YamlLoadError(f"mapping keys must be strings, got {key!r}", _mark(key_node))
                if key in out:
                    raise YamlLoadError(
                        f"duplicate key {key!r} (first at line {key_marks[(*path, key)].line})",
                        _mark(key_node),
                    )
                key_marks[(*path, key)] = _mark(key_node, file)
                out[key] = build(value_node, (*path, key))
            return out
        if isinstance(node, yaml.SequenceNode):
            return [build(item, (*path, i)) for i, item in enumerate(node.value)]
        return constructor.construct_object(node, deep=True)

    try:
        data = build(root, ())
    except yaml.YAMLError as exc:  # a tag or a scalar the safe loader refuses, e.g. !!python/name
        raise _load_error(exc, text) from exc
    except ValueError as exc:  # a scalar that looks like a date but is none, e.g. 2026-13-45
        raise YamlLoadError(f"invalid YAML value: {exc}", None) from exc
    finally:
        constructor.dispose()
    return Located(data, marks, key_marks)
