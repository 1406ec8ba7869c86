"""The transform kinds: one registry. Each kind is one module holding its recipe model beside its behaviour and
ending with `KIND = Kind(Model, Behaviour)`; the recipe's union, the JSON Schema and the engine's dispatch are all
derived from this table, so a new kind is one module, one line here, and its tests.
May import: the shared modules (errors, results, fields) only; the recipe imports this package, not the reverse."""

from __future__ import annotations

from toolkit.transforms import (
    add_import,
    assign,
    deploy,
    dict_entries,
    dispatch,
    replace_body,
    set_kwarg,
    statements,
    symlink,
)
from toolkit.transforms.base import Context, EditKind, FileKind, Kind, ModuleEdit, TransformBase

KINDS: dict[str, Kind] = {k.name: k for k in (
    set_kwarg.KIND,
    assign.KIND,
    dict_entries.KIND,
    dispatch.KIND,
    add_import.KIND,
    statements.KIND,
    replace_body.KIND,
    deploy.KIND,
    symlink.KIND,
)}


def edit_kind(spec: ModuleEdit, ctx: Context) -> EditKind:
    made = KINDS[spec.kind].behaviour(spec, ctx)
    assert KINDS[spec.kind].edits_python
    return made  # type: ignore[return-value]


def file_kind(spec: TransformBase, ctx: Context) -> FileKind:
    made = KINDS[spec.kind].behaviour(spec, ctx)
    assert not KINDS[spec.kind].edits_python
    return made  # type: ignore[return-value]
