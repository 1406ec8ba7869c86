"""What a vLLM release's server accepts, read from its source with ast (vLLM is never imported)."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Iterator
from pathlib import Path

# where vLLM's server flags and tool parsers are declared (0.6.x through 0.10.x)
PARSER_FILES = ("vllm/engine/arg_utils.py", "vllm/entrypoints/openai/cli_args.py")
TOOL_PARSER_DIR = "vllm/entrypoints/openai/tool_parsers"


def _method_calls(text: str, method: str) -> Iterator[ast.Call]:
    """Every `<anything>.method(...)` call in a module (none if it does not parse)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method:
            yield node


# lint reads the same release files for every recipe and variant it checks (a grid build lints each variant):
# parsing is the cost, and the answer is a function of the text
@functools.lru_cache(maxsize=512)
def flags_in_source(text: str) -> frozenset[str]:
    """Every `--flag` given as a positional string to an `add_argument(...)` call."""
    return frozenset({arg.value[2:] for call in _method_calls(text, "add_argument") for arg in call.args
                      if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--")})


@functools.lru_cache(maxsize=512)
def tool_parsers_in_source(text: str) -> frozenset[str]:
    """Names registered with `@ToolParserManager.register_module("name")` (a string or a list of them)."""
    found: set[str] = set()
    for call in _method_calls(text, "register_module"):
        if call.args:
            first = call.args[0]
            values: Iterable[ast.expr] = first.elts if isinstance(first, ast.List | ast.Tuple) else [first]
            found.update(v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str))
    return frozenset(found)


def release_flags(tree: Path) -> set[str]:
    flags: set[str] = set()
    for rel in PARSER_FILES:
        path = tree / rel
        if path.is_file():
            flags |= flags_in_source(path.read_text(encoding="utf-8"))
    return flags


def release_tool_parsers(tree: Path) -> set[str]:
    names: set[str] = set()
    folder = tree / TOOL_PARSER_DIR
    for path in sorted(folder.glob("*.py")) if folder.is_dir() else []:
        names |= tool_parsers_in_source(path.read_text(encoding="utf-8"))
    return names


def python_files(paths: Iterable[Path]) -> Iterable[tuple[Path, str]]:
    for path in paths:
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.suffix == ".py" else []
        for f in files:
            if "__pycache__" not in f.parts:
                yield f, f.read_text(encoding="utf-8", errors="replace")
