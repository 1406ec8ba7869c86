"""`toolkit vendor compare`: which public release a vendor tree is built on, file by file.

The vendor's package (e.g. a copy of the CoreX image's `vllm/`, CRLF, no metadata) is compared with candidate
releases fetched by pip (cached): its Python files LF-normalised, counted identical, differing (with the size of the
diff), only in the vendor tree or only upstream. The closest candidate has the most identical files. For each file
that differs or only the vendor has, the top-level modules it imports that no candidate imports anywhere are listed:
those are the vendor's own libraries (ixformer on CoreX), which the CPU runtime must stand in
(`base_image.gpu_libraries`).
"""

from __future__ import annotations

import ast
import difflib
import functools
import hashlib
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from toolkit.errors import InputError
from toolkit.inputs import fetch_reference
from toolkit.recipe import LoadedRecipe
from toolkit.results import Report


@dataclass(frozen=True)
class FileDiff:
    file: str
    diff_lines: int  # lines added plus lines removed (unified diff, CR stripped)
    vendor_imports: tuple[str, ...] = ()  # top-level modules imported here and by no candidate


@dataclass
class Candidate:
    spec: str
    identical: int = 0
    differing: list[FileDiff] = field(default_factory=list)
    only_vendor: list[FileDiff] = field(default_factory=list)
    only_upstream: list[str] = field(default_factory=list)

    @property
    def diff_lines(self) -> int:
        return sum(d.diff_lines for d in self.differing)

    def rank(self) -> tuple[int, int, int]:
        """Closest first: most identical files, then fewest differing, then the smallest diff."""
        return (-self.identical, len(self.differing), self.diff_lines)

    def as_json(self) -> dict[str, object]:
        return {"candidate": self.spec, "identical": self.identical, "differing": len(self.differing),
                "diff_lines": self.diff_lines, "only_vendor": [d.file for d in self.only_vendor],
                "only_upstream": self.only_upstream,
                "files": [{"file": d.file, "diff_lines": d.diff_lines, "vendor_imports": list(d.vendor_imports)}
                          for d in self.differing],
                "only_vendor_files": [{"file": d.file, "vendor_imports": list(d.vendor_imports)}
                                      for d in self.only_vendor]}


@dataclass(frozen=True)
class Comparison:
    package: str
    tree: Path  # the folder holding the package
    candidates: tuple[Candidate, ...]  # closest first
    missing: tuple[tuple[str, str], ...] = ()  # (spec, why) for guessed neighbours pip could not fetch

    @property
    def closest(self) -> Candidate:
        return self.candidates[0]

    def vendor_libraries(self) -> list[str]:
        """The modules the vendor tree imports that no candidate imports (against the closest candidate)."""
        found = {m for d in (*self.closest.differing, *self.closest.only_vendor) for m in d.vendor_imports}
        return sorted(found)


def neighbours(spec: str) -> list[str]:
    """The reference and the releases around it that a vendor build is usually taken from: the previous patch
    release, the release itself and its first post-release (e.g. 0.6.2, 0.6.3, 0.6.3.post1 for 0.6.3)."""
    name, _, text = spec.partition("==")
    try:
        version = Version(text)
    except InvalidVersion:
        raise InputError(f"{spec}: not name==version", hint="e.g. vllm==0.6.3") from None
    major, minor, patch = (*version.release, 0, 0)[:3]
    base = f"{major}.{minor}.{patch}"
    out = [f"{major}.{minor}.{patch - 1}"] if patch > 0 else []
    out += [base, f"{base}.post1"]
    if str(version) not in out:
        out.append(str(version))
    return [f"{name}=={v}" for v in out]


def _texts(package_dir: Path) -> dict[str, bytes]:
    """Every Python file of a package, LF-normalised, by its path from the package's parent (e.g. vllm/x.py)."""
    top = package_dir.parent
    return {p.relative_to(top).as_posix(): p.read_bytes().replace(b"\r\n", b"\n")
            for p in sorted(package_dir.rglob("*.py")) if "__pycache__" not in p.parts}


# the statement fields a statement nests others in (an import is a statement, never inside an expression)
_BODIES = ("body", "orelse", "finalbody", "handlers", "cases")


@functools.lru_cache(maxsize=4096)
def _top_imports(data: bytes) -> frozenset[str]:
    """The top-level modules a file imports anywhere (in functions, try blocks, branches), absolute imports only.

    Remembered by content: the candidate releases share most of their files, and lint and `vendor compare` ask
    again for the same references (the whole-tree `ast.walk` this replaced was 20 s of a three-candidate compare
    run twice)."""
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError):
        return frozenset()
    found: set[str] = set()
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.module and not node.level:
                found.add(node.module.split(".")[0])
        else:
            for name in _BODIES:
                stack.extend(getattr(node, name, ()))
    return frozenset(found)


def _diff_lines(a: bytes, b: bytes) -> int:
    old = a.decode("utf-8", "replace").splitlines()
    new = b.decode("utf-8", "replace").splitlines()
    return sum(1 for line in difflib.unified_diff(old, new, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---")))


def package_dir(root: Path, package: str) -> Path:
    """`root` is the package folder itself or a folder holding it."""
    if (root / package).is_dir():
        return root / package
    if root.name == package and root.is_dir():
        return root
    raise InputError(f"no {package}/ package in {root}",
                     hint=f"pass the folder that holds {package}/ (a site-packages folder), or {package}/ itself")


def compare(vendor: Path, package: str, specs: Iterable[str], python: str, platform: str,
            guessed: bool = False) -> Comparison:
    """Compare a vendor package folder with each candidate release (fetched by pip, cached).

    guessed: the specs are neighbours the toolkit made up: one pip cannot fetch is noted, not an error."""
    ours = _texts(vendor)
    if not ours:
        raise InputError(f"{vendor} holds no Python files", hint=f"pass the folder of the vendor's {package}/")
    candidates: list[Candidate] = []
    missing: list[tuple[str, str]] = []
    upstream: dict[str, dict[str, bytes]] = {}
    for spec in dict.fromkeys(specs):
        try:
            print(f"vendor compare: {spec} (fetched by pip once, cached)", file=sys.stderr, flush=True)
            upstream[spec] = _texts(package_dir(fetch_reference(spec, python, platform), package))
        except InputError as exc:
            if not guessed:
                raise
            missing.append((spec, str(exc)))
    if not upstream:
        raise InputError("no candidate release could be fetched: " + "; ".join(f"{s}: {w}" for s, w in missing),
                         hint="name them with --candidates NAME==VERSION,...")
    known = {package} | set(sys.stdlib_module_names)
    for files in upstream.values():
        for data in files.values():
            known |= _top_imports(data)

    def vendor_imports(data: bytes) -> tuple[str, ...]:
        return tuple(sorted(_top_imports(data) - known))

    for spec, theirs in upstream.items():
        candidate = Candidate(spec)
        digest = {rel: hashlib.sha256(data).digest() for rel, data in theirs.items()}
        for rel, data in ours.items():
            if rel not in theirs:
                candidate.only_vendor.append(FileDiff(rel, len(data.splitlines()), vendor_imports(data)))
            elif hashlib.sha256(data).digest() == digest[rel]:
                candidate.identical += 1
            else:
                candidate.differing.append(FileDiff(rel, _diff_lines(theirs[rel], data), vendor_imports(data)))
        candidate.only_upstream = sorted(set(theirs) - set(ours))
        candidates.append(candidate)
    candidates.sort(key=Candidate.rank)
    return Comparison(package, vendor.parent, tuple(candidates), tuple(missing))



def report_of(loaded: LoadedRecipe, result: Comparison, installed: set[str] | None, top: int = 12) -> Report:
    """The `vendor compare` report: a row per candidate, the closest, the vendor's libraries, the files.

    installed: which of the vendor-only imports the CPU runtime has (None: no runtime here to ask)."""
    recipe = loaded.recipe
    closest = result.closest
    rows = tuple((c.spec, str(c.identical), str(len(c.differing)), str(c.diff_lines), str(len(c.only_vendor)),
                  str(len(c.only_upstream)), "closest" if c is closest else "") for c in result.candidates)
    notes = [f"{result.tree / result.package} is closest to {closest.spec}: {closest.identical} file(s) identical, "
             f"{len(closest.differing)} differ ({closest.diff_lines} diff lines), {len(closest.only_vendor)} only in "
             f"the vendor tree, {len(closest.only_upstream)} only upstream (Python files, line endings normalised)"]
    origin = loaded.where("vendor", "reference")
    if closest.spec != recipe.vendor.reference:
        notes.append(f"vendor.reference ({origin}) is {recipe.vendor.reference}, not the closest: set it "
                     f"to {closest.spec} so the trial and preflight run on the vendor's true base")
    else:
        notes.append(f"vendor.reference ({origin}) is the closest candidate")
    imported = result.vendor_libraries()
    libraries = [m for m in imported if m not in (installed or set())]
    undeclared = [m for m in libraries if m not in recipe.base_image.gpu_library_names]
    if imported:
        said = f"the vendor tree imports modules no candidate imports: {', '.join(imported)}"
        if installed:
            said += f" ({', '.join(sorted(installed))} installed in the CPU runtime)"
        elif installed is None:
            said += " (no CPU runtime here to tell installed packages from the vendor's libraries)"
        if undeclared:
            said += (f"; not in base_image.gpu_libraries: {', '.join(undeclared)}: add the GPU-only ones there, or "
                     "preflight cannot import the tree")
        elif libraries:
            said += f"; the vendor's libraries {', '.join(libraries)} are declared in base_image.gpu_libraries"
        notes.append(said)
    shown = sorted(closest.differing, key=lambda d: -d.diff_lines)
    for d in shown[:top]:
        notes.append(f"differs from {closest.spec}: {d.file} ({d.diff_lines} diff lines"
                     + (f"; imports {', '.join(d.vendor_imports)}" if d.vendor_imports else "") + ")")
    if len(shown) > top:
        notes.append(f"... and {len(shown) - top} more differing file(s) (--top N, or --json for all)")
    for d in closest.only_vendor:
        notes.append(f"only in the vendor tree: {d.file}"
                     + (f" (imports {', '.join(d.vendor_imports)})" if d.vendor_imports else ""))
    notes.extend(f"candidate {spec} not compared: {why}" for spec, why in result.missing)
    return Report("vendor compare", str(loaded.path), notes=tuple(notes), rows=rows,
                  columns=("candidate", "identical", "differing", "diff lines", "only vendor", "only upstream", ""),
                  extra={"vendor": str(result.tree / result.package), "closest": closest.spec,
                         "vendor_libraries": libraries, "undeclared_gpu_libraries": undeclared,
                         "candidates": [c.as_json() for c in result.candidates],
                         "not_compared": [{"candidate": s, "why": w} for s, w in result.missing]})
