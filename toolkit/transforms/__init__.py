"""The transform kinds, registered in one table each for source edits and filesystem edits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from toolkit.recipe import SourceTransform, TransformBase
from toolkit.transforms.add_import import AddImportKind
from toolkit.transforms.assign import AssignKind
from toolkit.transforms.base import Context, SourceKind
from toolkit.transforms.deploy import DeployKind
from toolkit.transforms.dict_entries import DictEntriesKind
from toolkit.transforms.dispatch import DispatchKind
from toolkit.transforms.replace_body import ReplaceBodyKind
from toolkit.transforms.set_kwarg import SetKwargKind
from toolkit.transforms.statements import StatementsKind
from toolkit.transforms.symlink import SymlinkKind

SOURCE_KINDS: dict[str, Callable[[Any, Context], SourceKind]] = {
    "set-kwarg": SetKwargKind,
    "assign": AssignKind,
    "dict-entries": DictEntriesKind,
    "dispatch": DispatchKind,
    "add-import": AddImportKind,
    "replace-body": ReplaceBodyKind,
    "statements": StatementsKind,
}

FileKind = DeployKind | SymlinkKind
FILE_KINDS: dict[str, Callable[[Any, Context], FileKind]] = {
    "deploy": DeployKind,
    "symlink": SymlinkKind,
}


def source_kind(spec: SourceTransform, ctx: Context) -> SourceKind:
    return SOURCE_KINDS[spec.kind](spec, ctx)


def file_kind(spec: TransformBase, ctx: Context) -> FileKind:
    return FILE_KINDS[spec.kind](spec, ctx)
