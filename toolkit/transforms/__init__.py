"""The transform kinds: one registry. Each kind is one module holding its recipe model beside its behaviour and
ending with `KIND = Kind(Model, Behaviour)`; the recipe's union, the JSON Schema and the engine's dispatch are all
derived from this table, so a new kind is one module, one line here, and its tests.
May import: the shared modules (errors, results, fields) only; the recipe imports this package, not the reverse."""

from __future__ import annotations

import types

# The registry: one line per kind. Every kind module imported here ends with `KIND = Kind(Model, Behaviour)` and
# is registered by being imported (the static import also keeps it in the in-image step's import closure).
from toolkit.transforms import (
    add_import,
    assign,
    deploy,
    dict_entries,
    dispatch,
    kernels,
    probe,
    replace_body,
    set_kwarg,
    statements,
    symlink,
)
from toolkit.transforms.base import Context, EditKind, FileKind, Kind, ModuleEdit, TransformBase

KINDS: dict[str, Kind] = {module.KIND.name: module.KIND for module in list(globals().values())
                          if isinstance(module, types.ModuleType) and isinstance(getattr(module, "KIND", None), Kind)}


def edit_kind(spec: ModuleEdit, ctx: Context) -> EditKind:
    made = KINDS[spec.kind].behaviour(spec, ctx)
    assert KINDS[spec.kind].edits_python
    return made  # type: ignore[return-value]


def file_kind(spec: TransformBase, ctx: Context) -> FileKind:
    made = KINDS[spec.kind].behaviour(spec, ctx)
    assert not KINDS[spec.kind].edits_python
    return made  # type: ignore[return-value]
