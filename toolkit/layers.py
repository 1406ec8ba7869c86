"""Recipe layers: a recipe `include:`s other recipe files and declares its own part last; every merged value keeps
the file:line it came from.

The merge rules, a later layer over an earlier one (the including file is the latest):
- a mapping merges key by key, recursively (serve.args, env, variants by name, a variant's args);
- any other value replaces the earlier one whole: scalars, and lists too (vendor.roots, checks.lf_only);
- `sources` and `packages` merge by `name`: a later item replaces the earlier one of that name, in its place;
- `transforms` concatenate in include order. An id is unique across every layer, unless the later transform says
  `instead_of: ID`: it then takes the place of the transform ID of a layer merged before it (one it includes, or
  one included before it), once (its id may be ID again, or a new one).
- Relative paths (`patches`, a source's `path` and `digests`) are relative to the file that declares them.

Inside one file, a `transforms` item `{defaults: {...}, transforms: [...]}` is a group: each member takes every
field of `defaults` it does not set itself (the probes' shared `requires` and `remove_when` said once).

`include:` takes paths relative to the including file, or `toolkit:NAME` for a layer the toolkit installs with
(its `layers/` folder). A missing file, a cycle and a layer included twice are errors that name the chain of
includes, file:line each.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.errors import RecipeError
from toolkit.resources import TOOLKIT_PATCHES, resource
from toolkit.yamlpos import Located, Mark, Path_, YamlLoadError, load

INCLUDE = "include"
INSTEAD_OF = "instead_of"
GROUP_DEFAULTS = "defaults"
TOOLKIT_LAYER = "toolkit:"  # `include: toolkit:NAME`: a layer the toolkit installs with
NAMED_LISTS = ("sources", "packages")  # lists merged by their items' `name`
LISTS_MERGED = {("transforms",), *((name,) for name in NAMED_LISTS)}
PATH_FIELDS = (("patches",), ("sources", "*", "path"), ("sources", "*", "digests"))


@dataclass
class Tree:
    """A YAML value with the marks of everything in it, keyed by paths relative to the value."""

    data: Any
    marks: dict[Path_, Mark] = field(default_factory=dict)
    key_marks: dict[Path_, Mark] = field(default_factory=dict)

    @classmethod
    def of(cls, located: Located) -> Tree:
        return cls(located.data, dict(located.marks), dict(located.key_marks))

    def sub(self, *path: str | int) -> Tree:
        """The value at path, with its marks re-keyed relative to it."""
        node = self.data
        for part in path:
            node = node[part]
        n = len(path)
        return Tree(node, {p[n:]: m for p, m in self.marks.items() if p[:n] == path},
                    {p[n:]: m for p, m in self.key_marks.items() if p[:n] == path and len(p) > n})

    def parts(self) -> list[Tree]:
        """Every item of a list, or every value of a mapping, as `sub` gives it: in one pass over the marks (a `sub`
        per item is a pass each, which made a recipe's transforms list quadratic in its marks)."""
        keys = list(range(len(self.data))) if isinstance(self.data, list) else list(self.data)
        marks: dict[str | int, dict[Path_, Mark]] = {key: {} for key in keys}
        key_marks: dict[str | int, dict[Path_, Mark]] = {key: {} for key in keys}
        for path, mark in self.marks.items():
            if path and path[0] in marks:
                marks[path[0]][path[1:]] = mark
        for path, mark in self.key_marks.items():
            if len(path) > 1 and path[0] in key_marks:
                key_marks[path[0]][path[1:]] = mark
        return [Tree(self.data[key], marks[key], key_marks[key]) for key in keys]

    def mark(self, *path: str | int) -> Mark | None:
        return self.key_marks.get(path) or self.marks.get(path)

    def located(self) -> Located:
        return Located(self.data, self.marks, self.key_marks)

    def put(self, key: str | int, value: Tree) -> None:
        """data[key] = value, with value's marks (a list index one past the end appends)."""
        appended = isinstance(self.data, list) and key == len(self.data)
        if appended:
            self.data.append(value.data)
        else:
            self.data[key] = value.data
        _graft(self.marks, (key,), value.marks, replace=not appended)
        _graft(self.key_marks, (key,), value.key_marks, replace=not appended)

    def append(self, value: Tree) -> None:
        self.put(len(self.data), value)

    def without(self, key: str) -> Tree:
        """A copy of this mapping without key, nor its marks."""
        return Tree({k: v for k, v in self.data.items() if k != key},
                    {p: m for p, m in self.marks.items() if p[:1] != (key,)},
                    {p: m for p, m in self.key_marks.items() if p[:1] != (key,)})


def _graft(marks: dict[Path_, Mark], at: Path_, tree_marks: dict[Path_, Mark], replace: bool = True) -> None:
    """Put a subtree's marks under `at`, dropping what stood there before (`replace`; a list's new last item has
    nothing there)."""
    n = len(at)
    for path in [p for p in marks if p[:n] == at and len(p) > n] if replace else []:
        del marks[path]
    for path, mark in tree_marks.items():
        marks[(*at, *path)] = mark


def error_at(mark: Mark | None, file: str, message: str, *, key: str | None = None, hint: str | None = None,
             chain: tuple[str, ...] = ()) -> RecipeError:
    """A RecipeError at a mark (its file, else `file`), with the chain of includes that led there."""
    return RecipeError(mark.file if mark and mark.file else file, mark.line if mark else None,
                       mark.column if mark else None, message + _via(chain), key=key, hint=hint)


def layer_folder() -> Path:
    return resource("layers")


def where(mark: Mark | None, file: str) -> str:
    return f"{mark.file or file}:{mark.line}" if mark else file


# -- groups ---------------------------------------------------------------------------------------------------------

def _expand_groups(transforms: Tree, file: str, outer: Tree | None = None) -> Tree:
    """A transforms list with every group replaced, in place, by its members (their defaults filled in)."""
    if not isinstance(transforms.data, list):
        return transforms  # the model says what is wrong with it
    out = Tree([])
    for index, node in enumerate(transforms.parts()):
        item = node.data
        if isinstance(item, dict) and GROUP_DEFAULTS in item:
            extra = sorted(set(item) - {GROUP_DEFAULTS, "transforms"})
            if extra or "transforms" not in item:
                raise error_at(node.mark(extra[0]) if extra else node.mark(), file,
                             f"a group of transforms has `defaults` and `transforms` only, got "
                             f"{', '.join(sorted(item))}", key=f"transforms.{index}",
                             hint="{defaults: {requires: [...], remove_when: ...}, transforms: [- id: ...]}")
            if not isinstance(item["transforms"], list):
                raise error_at(node.mark("transforms"), file, "a group's `transforms` is a list of transforms",
                             key=f"transforms.{index}.transforms")
            defaults = node.sub(GROUP_DEFAULTS)
            if not isinstance(defaults.data, dict) or "id" in defaults.data or "kind" in defaults.data:
                raise error_at(node.mark(GROUP_DEFAULTS), file, "a group's `defaults` is a mapping of fields every "
                             "member shares; `id` and `kind` are each member's own", key=f"transforms.{index}.defaults")
            if outer is not None:  # a group inside a group: the inner defaults over the outer
                defaults = _with_defaults(defaults, outer)
            members = _expand_groups(node.sub("transforms"), file, defaults)
            for member in members.parts():
                out.append(member)
            continue
        if outer is not None and isinstance(item, dict):
            node = _with_defaults(node, outer)
        out.append(node)
    return out


def _with_defaults(member: Tree, defaults: Tree) -> Tree:
    """`member` with every field of `defaults` it does not set, each keeping the mark of where defaults said it."""
    out = Tree(dict(member.data), dict(member.marks), dict(member.key_marks))
    for key in defaults.data:
        if key not in out.data:
            out.put(key, defaults.sub(key))
            out.key_marks[(key,)] = defaults.key_marks[(key,)]
    return out


# -- merging --------------------------------------------------------------------------------------------------------

def _merge_transforms(base: Tree, later: Tree, file: str) -> Tree:
    """The earlier layers' transforms, then the later file's: `instead_of` replaces one of the earlier ones."""
    out = Tree([])
    earlier: dict[str, int] = {}  # id -> position, of the earlier layers' transforms only
    replaced: dict[str, str] = {}  # id -> where the replacement that took its place is
    for index, item in enumerate(base.parts()):
        out.append(item)
        if isinstance(item.data, dict) and isinstance(item.data.get("id"), str):
            earlier.setdefault(item.data["id"], index)
    for index, item in enumerate(later.parts()):
        target = item.data.get(INSTEAD_OF) if isinstance(item.data, dict) else None
        if target is None:
            out.append(item)  # a duplicate id is the loader's to report, with both places
            continue
        mark = item.mark(INSTEAD_OF)
        if isinstance(target, str) and target not in replaced and target not in earlier:
            # perhaps a layer included before this file's includer has it: the includer's merge decides
            # (`unresolved` refuses what no merge took)
            out.append(item)
            continue
        if not isinstance(target, str) or target in replaced:
            why = (f"already replaced by the transform at {replaced[target]}" if isinstance(target, str)
                   else "not a transform id")
            raise error_at(mark, file, f"instead_of {target!r}: {why}", key=f"transforms.{index}.{INSTEAD_OF}",
                         hint="instead_of names a transform of an included layer (here: "
                         f"{', '.join(earlier) or 'none'})")
        position = earlier[target]
        replaced[target] = where(item.mark(), file)
        out.put(position, item.without(INSTEAD_OF))
    return out


def _merge_named(base: Tree, later: Tree, file: str, key: str) -> Tree:
    out = Tree([])
    names: dict[str, int] = {}
    for tree in (base, later):
        for index, item in enumerate(tree.parts()):
            name = item.data.get("name") if isinstance(item.data, dict) else None
            if name is not None and not isinstance(name, str):
                raise error_at(item.mark("name"), file, f"{key}[{index}].name is a string, got {name!r}",
                             key=f"{key}.{index}.name")
            if tree is later and name in names:
                out.put(names[name], item)
                continue
            if name is not None:
                names[name] = len(out.data)
            out.append(item)
    return out


def merge(base: Tree, later: Tree, file: str, path: Path_ = ()) -> Tree:
    """`later` over `base`, by the rules in the module's docstring."""
    if path in LISTS_MERGED:
        key = str(path[0])
        for tree in (base, later):
            if not isinstance(tree.data, list):
                raise error_at(tree.mark(), file, f"{key} is a list (a layer's list is merged with the others)",
                             key=key)
        return _merge_transforms(base, later, file) if key == "transforms" else _merge_named(base, later, file, key)
    if not (isinstance(base.data, dict) and isinstance(later.data, dict)):
        return later
    out = Tree(dict(base.data), dict(base.marks), dict(base.key_marks))
    if () in later.marks:
        out.marks[()] = later.marks[()]  # the mapping is where its latest layer writes it (a missing key points there)
    for key in later.data:
        empty = Tree([]) if (*path, key) in LISTS_MERGED else None  # so the later list is checked as a merge
        earlier = base.sub(key) if key in base.data else empty
        value = later.sub(key) if earlier is None else merge(earlier, later.sub(key), file, (*path, key))
        out.put(key, value)
        if (key,) in later.key_marks:
            out.key_marks[(key,)] = later.key_marks[(key,)]
    return out


# -- one file and its includes ---------------------------------------------------------------------------------------

def _via(chain: tuple[str, ...]) -> str:
    return "".join(f"\n  included from {where}" for where in reversed(chain))


def _read(path: Path, shown: str, mark: Mark | None, file: str, chain: tuple[str, ...]) -> str:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise error_at(mark, file, f"included recipe file {shown} not found", key=INCLUDE, chain=chain,
                     hint="include paths are relative to the including file; `toolkit:NAME` names a layer the "
                     f"toolkit installs with ({layer_folder()})") from None
    except OSError as exc:
        raise error_at(mark, file, f"cannot read included recipe file {shown}: {exc.strerror}", key=INCLUDE,
                     chain=chain) from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise RecipeError(shown, None, None, f"recipe is not UTF-8 ({exc.reason} at byte {exc.start})"
                          + _via((*chain, where(mark, file)))) from None


def _includes(tree: Tree, file: str, chain: tuple[str, ...]) -> list[tuple[str, Mark | None]]:
    if INCLUDE not in tree.data:
        return []
    value = tree.data[INCLUDE]
    pairs = [(item, tree.mark(INCLUDE, i)) for i, item in enumerate(value)] if isinstance(value, list) \
        else [(value, tree.mark(INCLUDE))]
    for item, mark in pairs:
        name = item.removeprefix(TOOLKIT_LAYER) if isinstance(item, str) else ""
        if not name or (item.startswith(TOOLKIT_LAYER) and ".." in Path(name).parts):
            raise error_at(mark, file, f"include takes recipe files, got {item!r} (a path relative to this file, or "
                         f"{TOOLKIT_LAYER}NAME for a layer installed with the toolkit)", key=INCLUDE, chain=chain)
    return pairs


def _target(item: str, including: Path) -> tuple[Path, str]:
    """Where an include points, and how to name it in messages (the real path where a symlink makes the spelled
    one lie: `..` after a symlinked folder is the link target's parent)."""
    if item.startswith(TOOLKIT_LAYER):
        return layer_folder() / item[len(TOOLKIT_LAYER):], item
    path = including.parent / item
    shown = os.path.normpath(str(path))
    return path, shown if Path(shown).resolve() == path.resolve() else str(path.resolve())


def _rebase(tree: Tree, folder: Path, top: Path) -> None:
    """Relative path fields of one file made relative to the top recipe's folder."""
    def fix(node: Any, pattern: tuple[str, ...]) -> Any:
        if not pattern:
            # `patches: toolkit:` names the toolkit's own folder, wherever the layer is
            if isinstance(node, str) and node != TOOLKIT_PATCHES and not os.path.isabs(node):
                return os.path.relpath((folder / node).resolve(), top.resolve())
            return node
        head, rest = pattern[0], pattern[1:]
        if head == "*" and isinstance(node, list):
            return [fix(item, rest) for item in node]
        if isinstance(node, dict) and head in node:
            return {**node, head: fix(node[head], rest)}
        return node

    if folder.resolve() == top.resolve():
        return
    for pattern in PATH_FIELDS:
        tree.data = fix(tree.data, pattern)


@dataclass
class _Walk:
    """One compose: the top recipe's folder, the files in merge order, and where each was first included."""

    top: Path
    files: list[str] = field(default_factory=list)
    included: dict[Path, str] = field(default_factory=dict)


def _compose(located: Located, file: str, path: Path, chain: tuple[str, ...], seen: tuple[Path, ...],
             walk: _Walk) -> Tree:
    tree = Tree.of(located)
    if not isinstance(tree.data, dict):
        return tree
    base = Tree({})
    for item, mark in _includes(tree, file, chain):
        target, shown = _target(item, path)
        here = (*chain, where(mark, file))
        resolved = target.resolve()
        if resolved in seen:
            cycle = " -> ".join([*(str(s) for s in seen[seen.index(resolved):]), str(resolved)])
            raise error_at(mark, file, f"include cycle: {cycle}", key=INCLUDE, chain=chain,
                         hint="a layer cannot include itself, directly or through another layer")
        if resolved in walk.included:
            raise error_at(mark, file, f"{shown} is included twice (first at {walk.included[resolved]})", key=INCLUDE,
                         chain=chain, hint="include each layer once: a second include would repeat its transforms")
        walk.included[resolved] = where(mark, file)
        text = _read(target, shown, mark, file, chain)
        try:
            sub = load(text, shown)
        except YamlLoadError as exc:
            raise RecipeError(shown, exc.mark.line if exc.mark else None, exc.mark.column if exc.mark else None,
                              exc.message + _via(here)) from None
        if not isinstance(sub.data, dict):
            raise error_at(mark, file, f"included recipe file {shown} is not a YAML mapping", key=INCLUDE, chain=chain)
        base = merge(base, _compose(sub, shown, target, here, (*seen, resolved), walk), shown)
    own = tree.without(INCLUDE)
    if "transforms" in own.data:
        own.put("transforms", _expand_groups(own.sub("transforms"), file))
    _rebase(own, path.parent, walk.top)
    walk.files.append(file)
    return merge(base, own, file)


def compose(located: Located, file: str) -> tuple[Located, list[str]]:
    """A loaded recipe with its includes merged in and its groups expanded; and the files it is made of, in merge
    order (the recipe itself last)."""
    path = Path(file)
    walk = _Walk(path.parent)
    tree = _compose(located, file, path, (), (path.resolve(),), walk)
    _unresolved(tree, file)
    return tree.located(), walk.files


def _unresolved(tree: Tree, file: str) -> None:
    """An `instead_of` no merge took: its id is in no layer merged before the one that says it."""
    if not isinstance(tree.data, dict) or not isinstance(tree.data.get("transforms"), list):
        return
    transforms = tree.sub("transforms")
    for index, item in enumerate(transforms.parts()):
        target = item.data.get(INSTEAD_OF) if isinstance(item.data, dict) else None
        if target is not None:
            mark = item.mark(INSTEAD_OF)
            shown = mark.file if mark is not None and mark.file else file
            before = [t.get("id") for t in transforms.data[:index] if isinstance(t, dict)]
            raise error_at(mark, shown, f"instead_of {target!r}: no earlier layer has a transform of that "
                         "id", key=f"transforms.{index}.{INSTEAD_OF}",
                         hint="instead_of names a transform of a layer merged before this one (here: "
                         f"{', '.join(map(str, before)) or 'none'})")
