"""What the server needs at start, checked by reading the patched vendor files (vLLM is never imported).

Every flag of the run config is added by the patched CLI modules, the tool-call parser and the reasoning
parser the run config names are registered, each architecture the recipe registers resolves to a class that
exists, and every Python file the recipe deploys compiles. The in-image step prints one line per check; host
verify reports failures as findings.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from toolkit.recipe import Recipe
from toolkit.transforms.deploy import Deploy
from toolkit.transforms.dict_entries import DictEntries
from toolkit.transforms.kernels import Kernels

REGISTRY = "vllm/model_executor/models/registry.py"
CLI_MODULES = ("vllm/entrypoints/openai/cli_args.py", "vllm/engine/arg_utils.py")
TOOL_PARSERS = "vllm/entrypoints/openai/tool_parsers"
REASONING = "vllm/reasoning"


@dataclass(frozen=True)
class Check:
    ok: bool
    name: str  # what was checked, e.g. "flag --reasoning-parser"
    detail: str


def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"), str(path))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


def _calls(tree: ast.AST, method: str) -> Iterator[ast.Call]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name == method:
                yield node


def _names(node: ast.expr) -> list[str]:
    """The string(s) a registration call's first argument gives (a name or a list of names)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.List | ast.Tuple):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def flags(root: Path, args: list[str]) -> Iterator[Check]:
    known: set[str] = set()
    for rel in CLI_MODULES:
        tree = _parse(root / rel)
        for call in _calls(tree, "add_argument") if tree else ():
            known.update(n for a in call.args for n in _names(a) if n.startswith("--"))
    for arg in args:
        flag = "--" + arg
        yield Check(flag in known, f"flag {flag}", "added by the patched CLI modules" if flag in known else
                    f"no add_argument({flag!r}) in {' or '.join(CLI_MODULES)}: the server exits with "
                    "'unrecognized arguments'")


def tool_parser(root: Path, name: str) -> Check:
    folder = root / TOOL_PARSERS
    init = _parse(folder / "__init__.py")
    imported = {n.module for n in ast.walk(init) if isinstance(n, ast.ImportFrom) and n.level == 1} if init else set()
    for path in sorted(folder.glob("*.py")):
        tree = _parse(path)
        if tree and any(name in _names(c.args[0]) for c in _calls(tree, "register_module") if c.args):
            if path.stem in imported:
                return Check(True, f"tool parser {name}", f"registered in {path.name}, imported by the package")
            return Check(False, f"tool parser {name}", f"{path.name} registers it, but {TOOL_PARSERS}/__init__.py "
                         "does not import it: it is never registered")
    return Check(False, f"tool parser {name}", f"no module in {TOOL_PARSERS} registers it")


def reasoning_parser(root: Path, name: str) -> Check:
    folder = root / REASONING
    if not (folder / "__init__.py").is_file():
        return Check(False, f"reasoning parser {name}", f"no {REASONING} package: this vLLM has no reasoning parsers")
    for path in sorted(folder.glob("*.py")):
        tree = _parse(path)
        calls = [*_calls(tree, "register_module"), *_calls(tree, "register_lazy")] if tree else []
        if any(name in _names(c.args[0]) for c in calls if c.args):
            return Check(True, f"reasoning parser {name}", f"registered in {REASONING}/{path.name}")
    return Check(False, f"reasoning parser {name}", f"no module in {REASONING} registers it")


def architectures(root: Path, recipe: Recipe) -> Iterator[Check]:
    """Each architecture the recipe adds to the registry names a module and a class that exist."""
    for t in recipe.for_package(recipe.vendor.package):
        if not (isinstance(t, DictEntries) and t.file == REGISTRY):
            continue
        for arch, value in t.entries.items():
            try:
                module, cls = ast.literal_eval(value)
            except (ValueError, SyntaxError, TypeError):
                yield Check(False, f"architecture {arch}", f"entry {value} is not a (module, class) pair")
                continue
            path = root / "vllm/model_executor/models" / f"{module}.py"
            tree = _parse(path)
            found = tree is not None and any(isinstance(n, ast.ClassDef) and n.name == cls for n in ast.walk(tree))
            yield Check(found, f"architecture {arch}", f"-> {module}.{cls}" if found else
                        f"-> {module}.{cls}, but {path.relative_to(root)} " +
                        ("defines no class " + cls if tree is not None else "is missing or does not parse"))


def deployed_modules(root: Path, recipe: Recipe) -> Iterator[Check]:
    for t in recipe.for_package(recipe.vendor.package):
        if not isinstance(t, Deploy) or isinstance(t, Kernels) or t.dest.startswith("/"):
            continue  # a prebuilt kernel is not Python: nothing to compile
        dest = root / t.dest
        files = [dest] if dest.is_file() else sorted(dest.rglob("*.py")) if dest.is_dir() else []
        for path in (p for p in files if p.suffix == ".py"):
            try:
                compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
            except (SyntaxError, ValueError) as exc:
                yield Check(False, f"compile {path.relative_to(root)}", str(exc))
                continue
            yield Check(True, f"compile {path.relative_to(root)}", "compiles")


def startup_checks(root: Path, recipe: Recipe) -> list[Check]:
    args = [k for k, v in recipe.serve.args.items() if v is not None and v is not False]
    checks = [*flags(root, args), *architectures(root, recipe), *deployed_modules(root, recipe)]
    parser = recipe.serve.args.get("tool-call-parser")
    if isinstance(parser, str):
        checks.append(tool_parser(root, parser))
    reasoning = recipe.serve.args.get("reasoning-parser")
    if isinstance(reasoning, str):
        checks.append(reasoning_parser(root, reasoning))
    return checks
