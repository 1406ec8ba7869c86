"""The package layout shows the stages data flows through, and imports flow one way: no module imports a later
stage (read with ast, so a violation is found without running anything)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

# in the order data flows; a module may import its own stage and earlier ones
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("shared", ("toolkit", "toolkit.errors", "toolkit.results", "toolkit.fields", "toolkit.yamlpos",
                "toolkit.resources", "toolkit.markers")),
    ("transforms", ("toolkit.transforms",)),
    ("recipe", ("toolkit.layers", "toolkit.recipe", "toolkit.variants")),
    ("sources", ("toolkit.inputs", "toolkit.corexlike", "toolkit.pinned", "toolkit.pyenv", "toolkit.compare")),
    ("engine", ("toolkit.engine", "toolkit.startup", "toolkit.trial")),
    ("lint", ("toolkit.lint",)),
    ("submission", ("toolkit.submission",)),
    ("runtime", ("toolkit.runtime",)),
    ("bench", ("toolkit.bench",)),
    ("rehearsal", ("toolkit.rehearsal",)),
    ("estimate", ("toolkit.estimate",)),
    ("upgrade", ("toolkit.upgrade",)),
    ("commands", ("toolkit.commands", "toolkit.api")),
    ("cli", ("toolkit.report", "toolkit.cli", "toolkit.entry", "toolkit.testing", "toolkit.__main__", "toolkit.docs")),
]
PACKAGES = ("toolkit.transforms", "toolkit.engine", "toolkit.lint", "toolkit.submission", "toolkit.runtime",
            "toolkit.bench", "toolkit.rehearsal", "toolkit.estimate", "toolkit.upgrade", "toolkit.commands")


def stage_of(module: str) -> int:
    matches = [(len(prefix), rank) for rank, (_, prefixes) in enumerate(STAGES) for prefix in prefixes
               if module == prefix or (prefix != "toolkit" and module.startswith(prefix + "."))]
    assert matches, f"{module} belongs to no stage: add it to STAGES in {__file__}"
    return max(matches)[1]


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted((REPO / "toolkit").rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        out[name] = path
    return out


def imports(path: Path) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("toolkit"):
            found.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found.extend((a.name, node.lineno) for a in node.names if a.name.startswith("toolkit"))
    return found


def test_no_module_imports_a_later_stage() -> None:
    wrong = []
    for name, path in modules().items():
        own = stage_of(name)
        for target, line in imports(path):
            if stage_of(target) > own:
                wrong.append(f"{path.relative_to(REPO)}:{line}: {STAGES[own][0]} imports {target} "
                             f"({STAGES[stage_of(target)][0]})")
    assert wrong == []


def test_each_stage_package_says_what_it_owns_and_may_import() -> None:
    for package in PACKAGES:
        doc = ast.get_docstring(ast.parse((REPO / package.replace(".", "/") / "__init__.py").read_text()))
        assert doc and "import" in doc, f"{package}/__init__.py: say what the package owns and what it may import"


def module_level_imports(path: Path) -> set[str]:
    """The toolkit modules a module imports at its top level, `if TYPE_CHECKING:` blocks included."""
    found: set[str] = set()
    body = list(ast.parse(path.read_text(encoding="utf-8")).body)
    while body:
        node = body.pop()
        if isinstance(node, ast.If):
            body.extend(node.body)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("toolkit"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("toolkit"))
    return found


def test_no_import_cycle_between_modules() -> None:
    graph = {name: {t for t in module_level_imports(path) if t in modules() and t != name}
             for name, path in modules().items()}
    cycles = []
    for start in graph:
        stack = [(start, [start])]
        while stack:
            node, trail = stack.pop()
            for target in graph[node]:
                if target == start and not (start.startswith(f"{target}.") or target.startswith(f"{start}.")):
                    cycles.append(" -> ".join([*trail, target]))
                elif target not in trail and len(trail) < 8:
                    stack.append((target, [*trail, target]))
    assert cycles == []


def test_no_module_reaches_into_another_modules_private_names() -> None:
    """`obj._name` on anything but self/cls/super(), and `from toolkit.x import _name`: a public API keeps its
    modules' insides to themselves (third-party and standard-library privates are the shims' business)."""
    wrong = []
    for path in modules().values():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        own = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("toolkit"):
                wrong += [f"{path.relative_to(REPO)}:{node.lineno}: imports {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            target = node.value
            if isinstance(target, ast.Name) and (target.id in ("self", "cls") or target.id in own):
                continue
            if ast.unparse(target).split(".")[0] in ("sys", "os", "threading"):  # the standard library's, for shims
                continue
            if isinstance(target, ast.Call) and isinstance(target.func, ast.Name) and target.func.id == "super":
                continue
            if ast.unparse(target).startswith("vllm"):  # the CPU runtime's shims of vLLM internals
                continue
            wrong.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert wrong == []
