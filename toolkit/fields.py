"""The field types recipe models share: strict models, names, paths and Python snippets, each validated in one
place that the loader and the JSON Schema both take it from."""

from __future__ import annotations

import functools
import keyword
import re
import textwrap
from pathlib import PurePosixPath
from typing import Annotated, Any

import libcst as cst
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

ID_PATTERN = r"^[a-z0-9][a-z0-9._-]*$"
ENV_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# a snippet's verdict is remembered by its text: the flagship's 108 snippets were parsed by libcst at every load
# (a load after the first 0.055-0.098 s -> 0.028-0.072 s), and lint, a build's variants and the tests load the same
# recipes again and again
@functools.lru_cache(maxsize=8192)
def _expression_error(value: str) -> str | None:
    try:
        cst.parse_expression(value)
    except cst.ParserSyntaxError as exc:
        return f"not a Python expression: {value!r} ({exc.message})"
    return None


def _python_expression(value: str) -> str:
    error = _expression_error(value)
    if error is not None:
        raise ValueError(error)
    return value


def relative_path(value: str) -> str:
    path = PurePosixPath(value)
    if path.is_absolute() or ".." in path.parts or "\\" in value or not value:
        raise ValueError(f"must be a relative POSIX path inside the tree, got {value!r}")
    return value


# Names are defined once, as a pattern plus a keyword ban; the loader and the JSON Schema both take them from here,
# so a value one accepts the other accepts too.
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED = rf"{_IDENT}(?:\.{_IDENT})*"
_KEYWORDS = "|".join(keyword.kwlist)


def banned(separators: str) -> str:
    edge = f"[{re.escape(separators)}]" if separators else "$^"
    return rf"(?:^|{edge})(?:{_KEYWORDS})(?:{edge}|$)"


def _name_field(pattern: str, separators: str, description: str) -> Any:
    return Field(pattern=f"^{pattern}$", description=description,
                 json_schema_extra={"not": {"pattern": banned(separators)}})


def _no_keyword(separators: str) -> AfterValidator:
    pattern = banned(separators)

    def check(value: str) -> str:
        if re.search(pattern, value):
            raise ValueError(f"{value!r} uses a Python keyword as a name")
        return value

    return AfterValidator(check)


PyExpr = Annotated[str, Field(description="A Python expression, compared structurally (formatting-independent)"),
                   AfterValidator(_python_expression)]
Identifier = Annotated[str, _name_field(_IDENT, "", "A Python identifier (not a keyword)"), _no_keyword("")]
DottedName = Annotated[str, _name_field(DOTTED, ".", "A dotted Python name, e.g. torch.ops.foo"), _no_keyword(".")]
ScopeName = Annotated[str, _name_field(f"(?:{DOTTED})?", ".", "A dotted scope; empty for the module"),
                      _no_keyword(".")]
CallableRef = Annotated[str, _name_field(f"{DOTTED}:{_IDENT}", ".:", "A callable as module.path:function"),
                        _no_keyword(".:")]


@functools.lru_cache(maxsize=8192)
def _block_error(value: str) -> str | None:
    try:
        module = cst.parse_module(textwrap.dedent(value).strip("\n") + "\n")
    except cst.ParserSyntaxError as exc:
        return f"not Python statements: {exc.message} at line {exc.raw_line}"
    return None if module.body else "no statement given"


def _python_block(value: str) -> str:
    error = _block_error(value)
    if error is not None:
        raise ValueError(error)
    return value


PyBlock = Annotated[str, Field(description="Python statements (dedented; compared structurally)"),
                    AfterValidator(_python_block)]


Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="A full sha256 in hex")]
# an operation a path owns, dotted from the whole to its parts (moe.routed-experts covers moe.routed-experts.reduce)
Operation = Annotated[str, Field(pattern=r"^[a-z0-9]+(?:[.-][a-z0-9]+)*$",
                                 description="An operation, dotted from the whole to its parts")]


