"""Recipe layers: a recipe `include:`s other recipe files and declares its own part last; every merged value keeps
the file:line it came from.

The merge rules, a later layer over an earlier one (the including file is the latest):
- a mapping merges key by key, recursively (serve.args, env, variants by name, a variant's args);
- any other value replaces the earlier one whole: scalars, and lists too (vendor.roots, checks.lf_only);
- `sources` and `packages` merge by `name`: a later item replaces the earlier one of that name, in its place;
- `transforms` concatenate in include order. An id is unique across every layer, unless the later transform says
  `instead_of: ID`: it then takes that earlier transform's place (its id may be ID again, or a new one).
- Relative paths (`patches`, a source's `path` and `digests`) are relative to the file that declares them.

Inside one file, a `transforms` item `{defaults: {...}, transforms: [...]}` is a group: each member takes every
field of `defaults` it does not set itself (the probes' shared `requires` and `remove_when` said once).

`include:` takes paths relative to the including file, or `toolkit:NAME` for a layer the toolkit installs with
(its `layers/` folder). A missing file and a cycle are errors that name the chain of includes, file:line each.
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

    def mark(self, *path: str | int) -> Mark | None:
        return self.key_marks.get(path) or self.marks.get(path)

    def located(self) -> Located:
        return Located(self.data, self.marks, self.key_marks)


def _graft(marks: dict[Path_, Mark], at: Path_, tree_marks: dict[Path_, Mark]) -> None:
    """Put a subtree's marks under `at`, dropping what stood there before."""
    n = len(at)
    for path in [p for p in marks if p[:n] == at and len(p) > n]:
        del marks[path]
    for path, mark in tree_marks.items():
        marks[(*at, *path)] = mark


def _error(mark: Mark | None, file: str, message: str, *, key: str | None = None, hint: str | None = None,
           chain: tuple[str, ...] = ()) -> RecipeError:
    via = "".join(f"\n  included from {where}" for where in reversed(chain))
    return RecipeError(mark.file if mark and mark.file else file, mark.line if mark else None,
                       mark.column if mark else None, message + via, key=key, hint=hint)


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
    for index, item in enumerate(transforms.data):
        node = transforms.sub(index)
        if isinstance(item, dict) and GROUP_DEFAULTS in item:
            extra = sorted(set(item) - {GROUP_DEFAULTS, "transforms"})
            if extra or "transforms" not in item:
                raise _error(node.mark(extra[0]) if extra else node.mark(), file,
                             f"a group of transforms has `defaults` and `transforms` only, got "
                             f"{', '.join(sorted(item))}", key=f"transforms.{index}",
                             hint="{defaults: {requires: [...], remove_when: ...}, transforms: [- id: ...]}")
            defaults = node.sub(GROUP_DEFAULTS)
            if not isinstance(defaults.data, dict) or "id" in defaults.data or "kind" in defaults.data:
                raise _error(node.mark(GROUP_DEFAULTS), file, "a group's `defaults` is a mapping of fields every "
                             "member shares; `id` and `kind` are each member's own", key=f"transforms.{index}.defaults")
            if outer is not None:  # a group inside a group: the inner defaults over the outer
                defaults = _with_defaults(defaults, outer)
            members = _expand_groups(node.sub("transforms"), file, defaults)
            for member in range(len(members.data)):
                _append(out, members.sub(member))
            continue
        if outer is not None and isinstance(item, dict):
            node = _with_defaults(node, outer)
        _append(out, node)
    return out


def _with_defaults(member: Tree, defaults: Tree) -> Tree:
    """`member` with every field of `defaults` it does not set, each keeping the mark of where defaults said it."""
    out = Tree(dict(member.data), dict(member.marks), dict(member.key_marks))
    for key, value in defaults.data.items():
        if key not in out.data:
            out.data[key] = value
            _graft(out.marks, (key,), defaults.sub(key).marks)
            _graft(out.key_marks, (key,), defaults.sub(key).key_marks)
            out.key_marks[(key,)] = defaults.key_marks[(key,)]
    return out


def _append(items: Tree, item: Tree) -> None:
    index = len(items.data)
    items.data.append(item.data)
    _graft(items.marks, (index,), item.marks)
    _graft(items.key_marks, (index,), item.key_marks)


# -- merging --------------------------------------------------------------------------------------------------------

def _merge_transforms(base: Tree, later: Tree, file: str) -> Tree:
    out = Tree([])
    ids: dict[str, int] = {}
    for index in range(len(base.data)):
        item = base.sub(index)
        _append(out, item)
        if isinstance(item.data, dict) and isinstance(item.data.get("id"), str):
            ids[item.data["id"]] = index
    for index in range(len(later.data)):
        item = later.sub(index)
        data = item.data
        if not isinstance(data, dict):
            _append(out, item)
            continue
        target = data.get(INSTEAD_OF)
        if target is not None:
            if target not in ids:
                raise _error(item.mark(INSTEAD_OF), file, f"instead_of {target!r}: no earlier layer has a transform "
                             "of that id", key=INSTEAD_OF, hint=f"earlier ids: {', '.join(ids) or 'none'}")
            position = ids.pop(target)
            replacement = Tree({k: v for k, v in data.items() if k != INSTEAD_OF},
                               {p: m for p, m in item.marks.items() if p[:1] != (INSTEAD_OF,)},
                               {p: m for p, m in item.key_marks.items() if p[:1] != (INSTEAD_OF,)})
            out.data[position] = replacement.data
            _graft(out.marks, (position,), replacement.marks)
            _graft(out.key_marks, (position,), replacement.key_marks)
            if isinstance(data.get("id"), str):
                ids.setdefault(data["id"], position)
            continue
        if isinstance(data.get("id"), str):
            ids.setdefault(data["id"], len(out.data))
        _append(out, item)  # a duplicate id is the loader's to report, with both places
    return out


def _merge_named(base: Tree, later: Tree) -> Tree:
    out = Tree([])
    names: dict[Any, int] = {}
    for index in range(len(base.data)):
        item = base.sub(index)
        if isinstance(item.data, dict) and "name" in item.data:
            names[item.data["name"]] = index
        _append(out, item)
    for index in range(len(later.data)):
        item = later.sub(index)
        name = item.data.get("name") if isinstance(item.data, dict) else None
        if name is not None and name in names:
            position = names[name]
            out.data[position] = item.data
            _graft(out.marks, (position,), item.marks)
            _graft(out.key_marks, (position,), item.key_marks)
        else:
            if name is not None:
                names[name] = len(out.data)
            _append(out, item)
    return out


def merge(base: Tree, later: Tree, file: str, path: Path_ = ()) -> Tree:
    """`later` over `base`, by the rules in the module's docstring."""
    if not (isinstance(base.data, dict) and isinstance(later.data, dict)):
        if path == ("transforms",) and isinstance(base.data, list) and isinstance(later.data, list):
            return _merge_transforms(base, later, file)
        if path in {(n,) for n in NAMED_LISTS} and isinstance(base.data, list) and isinstance(later.data, list):
            return _merge_named(base, later)
        return later
    out = Tree(dict(base.data), dict(base.marks), dict(base.key_marks))
    for key in later.data:
        value = merge(base.sub(key), later.sub(key), file, (*path, key)) if key in base.data else later.sub(key)
        out.data[key] = value.data
        _graft(out.marks, (key,), value.marks)
        _graft(out.key_marks, (key,), value.key_marks)
        if (key,) in later.key_marks:
            out.key_marks[(key,)] = later.key_marks[(key,)]
    return out


# -- one file and its includes ---------------------------------------------------------------------------------------

def _read(path: Path, shown: str, mark: Mark | None, file: str, chain: tuple[str, ...]) -> str:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise _error(mark, file, f"included recipe file {shown} not found", key=INCLUDE, chain=chain,
                     hint="include paths are relative to the including file; `toolkit:NAME` names a layer the "
                     f"toolkit installs with ({layer_folder()})") from None
    except OSError as exc:
        raise _error(mark, file, f"cannot read included recipe file {shown}: {exc.strerror}", key=INCLUDE,
                     chain=chain) from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise RecipeError(shown, None, None, f"recipe is not UTF-8 ({exc.reason} at byte {exc.start})") from None


def _includes(tree: Tree, file: str) -> list[tuple[str, Mark | None]]:
    if not isinstance(tree.data, dict) or INCLUDE not in tree.data:
        return []
    value = tree.data[INCLUDE]
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(i, str) and i for i in items):
        raise _error(tree.mark(INCLUDE), file, "include is a list of recipe files (relative to this file, or "
                     "toolkit:NAME)", key=INCLUDE)
    return [(item, tree.mark(INCLUDE, index) if isinstance(value, list) else tree.mark(INCLUDE))
            for index, item in enumerate(items)]


def _target(item: str, including: Path) -> tuple[Path, str]:
    """Where an include points, and how to name it in messages."""
    if item.startswith(TOOLKIT_LAYER):
        path = layer_folder() / item[len(TOOLKIT_LAYER):]
        return path, item
    path = including.parent / item
    return path, os.path.normpath(str(path))


def _rebase(tree: Tree, folder: Path, top: Path) -> None:
    """Relative path fields of one file made relative to the top recipe's folder."""
    def fix(node: Any, pattern: tuple[str, ...]) -> Any:
        if not pattern:
            # `patches: toolkit:` names the toolkit's own folder, wherever the layer is
            if isinstance(node, str) and node != TOOLKIT_PATCHES and not os.path.isabs(node):
                return os.path.relpath(os.path.normpath(folder / node), top)
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


def _compose(located: Located, file: str, path: Path, top: Path, chain: tuple[str, ...],
             seen: tuple[Path, ...], files: list[str]) -> Tree:
    tree = Tree.of(located)
    if not isinstance(tree.data, dict):
        return tree
    base: Tree | None = None
    for item, mark in _includes(tree, file):
        target, shown = _target(item, path)
        here = (*chain, where(mark, file))
        resolved = target.resolve()
        if resolved in seen:
            cycle = " -> ".join([*(str(s) for s in seen[seen.index(resolved):]), str(resolved)])
            raise _error(mark, file, f"include cycle: {cycle}", key=INCLUDE, chain=chain,
                         hint="a layer cannot include itself, directly or through another layer")
        text = _read(target, shown, mark, file, chain)
        try:
            sub = load(text, shown)
        except YamlLoadError as exc:
            raise RecipeError(shown, exc.mark.line if exc.mark else None, exc.mark.column if exc.mark else None,
                              exc.message + "".join(f"\n  included from {w}" for w in reversed(here))) from None
        if not isinstance(sub.data, dict):
            raise _error(mark, file, f"included recipe file {shown} is not a YAML mapping", key=INCLUDE, chain=chain)
        layer = _compose(sub, shown, target, top, here, (*seen, resolved), files)
        base = layer if base is None else merge(base, layer, shown)
    own = Tree({k: v for k, v in tree.data.items() if k != INCLUDE},
               {p: m for p, m in tree.marks.items() if p[:1] != (INCLUDE,)},
               {p: m for p, m in tree.key_marks.items() if p[:1] != (INCLUDE,)})
    if "transforms" in own.data:
        expanded = _expand_groups(own.sub("transforms"), file)
        own.data["transforms"] = expanded.data
        _graft(own.marks, ("transforms",), expanded.marks)
        _graft(own.key_marks, ("transforms",), expanded.key_marks)
    _rebase(own, path.parent, top)
    files.append(file)
    if base is None:
        return _strip_instead_of(own, file)
    return merge(base, own, file)


def _strip_instead_of(tree: Tree, file: str) -> Tree:
    """The bottom layer: nothing earlier to replace."""
    for index, item in enumerate(tree.data.get("transforms") or []):
        if isinstance(item, dict) and INSTEAD_OF in item:
            raise _error(tree.mark("transforms", index, INSTEAD_OF), file,
                         f"instead_of {item[INSTEAD_OF]!r}: no earlier layer has a transform of that id",
                         key=INSTEAD_OF, hint="instead_of replaces a transform of an included layer")
    return tree


def compose(located: Located, file: str) -> tuple[Located, list[str]]:
    """A loaded recipe with its includes merged in and its groups expanded; and the files it is made of, in merge
    order (the recipe itself last)."""
    path = Path(file)
    files: list[str] = []
    tree = _compose(located, file, path, path.parent, (), (path.resolve(),), files)
    return tree.located(), files
