"""`toolkit upgrade --write`: the layers rewritten with a round-trip YAML library (comments, key order, quoting and
layout kept), each change commented with the fate that made it. A file is written in place only where git says it is
committed and unchanged (the diff is then the review); otherwise only to `-o FILE`, which must not exist yet."""

from __future__ import annotations

import io
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import git
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import CommentMark
from ruamel.yaml.tokens import CommentToken

from toolkit.errors import InputError
from toolkit.recipe import LoadedRecipe
from toolkit.transforms.deploy import lf_digest
from toolkit.upgrade.fates import Fate, Outcome

# the layouts tried, in order: a file is written with the first that gives its own text back unchanged
LAYOUTS = ((2, 4, 2), (2, 2, 0), (2, 2, 2), (4, 4, 2))


@dataclass
class _Layer:
    path: Path
    text: str
    yaml: YAML
    data: Any
    changes: list[str] = field(default_factory=list)


def _load(path: Path) -> _Layer:
    text = path.read_text(encoding="utf-8")
    for mapping, sequence, offset in LAYOUTS:
        yaml = YAML()
        yaml.preserve_quotes = True
        yaml.width = 4096
        yaml.indent(mapping=mapping, sequence=sequence, offset=offset)
        data = yaml.load(text)
        out = io.StringIO()
        yaml.dump(data, out)
        if out.getvalue() == text:
            return _Layer(path, text, yaml, data)
    raise InputError(f"{path}: cannot be rewritten without changing its layout (no indentation the YAML library "
                     "writes gives this file's own text back)",
                     hint="apply the report's proposals by hand, or reindent the file (2 spaces, lists at 2) once")


def _find(items: Any, tid: str) -> tuple[CommentedSeq, int] | None:
    """The list holding a transform and its index, groups (`transforms:` under `defaults:`) walked."""
    if not isinstance(items, CommentedSeq):
        return None
    for i, item in enumerate(items):
        if isinstance(item, CommentedMap):
            if item.get("id") == tid:
                return items, i
            found = _find(item.get("transforms"), tid)
            if found is not None:
                return found
    return None


def _dash(seq: CommentedSeq, index: int) -> int:
    """The column of an item's dash (ruamel records where the item's own mapping starts, after `- `)."""
    return max(0, seq.lc.data[index][1] - 2) if index in seq.lc.data else 0


def _trailing(item: Any) -> Any:
    """The comment lines after a mapping (ruamel keeps them on its last key), or None."""
    if isinstance(item, CommentedMap) and item:
        tokens = item.ca.items.get(list(item)[-1])
        if tokens and len(tokens) > 2:
            return tokens[2]
    return None


def _remove(seq: CommentedSeq, index: int, note: str) -> None:
    """Delete an item, leaving `note` in its place and keeping every comment line around it: those before it stay
    (ruamel keeps them on the item before), those after it (the next item's) move onto the item before."""
    pad = " " * _dash(seq, index)
    after = _trailing(seq[index])
    rest = "" if after is None else after.value[1:] if after.value.startswith("\n") else after.value
    if index == 0:
        del seq[index]
        if seq:
            seq.yaml_set_comment_before_after_key(0, before=note, indent=len(pad))
        return
    previous = seq[index - 1]
    del seq[index]
    if not isinstance(previous, CommentedMap) or not previous:
        raise InputError(f"cannot remove the transform after {previous!r}: the item before it is not a mapping")
    tokens = previous.ca.items.setdefault(list(previous)[-1], [None, None, None, None])
    while len(tokens) < 4:
        tokens.append(None)
    before = tokens[2].value if tokens[2] is not None else "\n"
    tokens[2] = CommentToken(before + f"{pad}# {note}\n" + rest, CommentMark(0), None)


@dataclass(frozen=True)
class Written:
    path: Path
    changes: tuple[str, ...]


def write(loaded: LoadedRecipe, source: str, old_commit: str, new_commit: str, outcomes: list[Outcome],
          new_files: dict[str, bytes], output: Path | None) -> list[Written]:
    """Write the upgraded layers (and the source's digests lock, where it keeps one) for the files of the new
    commit; returns what was written (nothing when nothing changes)."""
    short = new_commit[:12]
    layers: dict[Path, _Layer] = {}

    def layer(origin_file: str) -> _Layer:
        path = Path(origin_file).resolve()
        if path not in layers:
            layers[path] = _load(path)
        return layers[path]

    index = next(i for i, s in enumerate(loaded.recipe.sources) if s.name == source)
    declared = loaded.recipe.sources[index]
    if declared.commit != new_commit:
        origin = loaded.origin("sources", index, "commit")
        assert origin is not None
        pin = layer(origin.file)
        entry = next(s for s in pin.data["sources"] if s.get("name") == source)
        entry["commit"] = new_commit
        was = declared.commit[:12] + ("" if declared.commit == old_commit else f", read at {old_commit[:12]}")
        said = entry.ca.items.get("commit", [None, None, None])[2:3]
        own = said[0].value.strip().lstrip("#").strip() if said and said[0] is not None else ""
        entry.yaml_add_eol_comment(f"{own + '; ' if own else ''}toolkit upgrade: was {was}", "commit")
        pin.changes.append(f"sources[{source}].commit {declared.commit[:12]} -> {short}")
    origins = {t.id: loaded.transform_origin(i) for i, t in enumerate(loaded.recipe.transforms)}
    for outcome in outcomes:
        origin = origins.get(outcome.transform)
        if origin is None or outcome.fate not in (Fate.MOVED, Fate.UPSTREAM):
            continue
        if outcome.fate is Fate.MOVED and not outcome.proposal:
            continue  # the same code, wrapped differently: the transform already applies there
        target = layer(origin.file)
        found = _find(target.data.get("transforms"), outcome.transform)
        if found is None:
            raise InputError(f"{origin}: transform {outcome.transform} is not where the recipe says it is",
                             hint="the file changed since the recipe was loaded: run upgrade again")
        seq, i = found
        if outcome.fate is Fate.UPSTREAM:
            _remove(seq, i, f"toolkit upgrade to {short}: removed {outcome.transform}, UPSTREAM: {outcome.detail}")
            target.changes.append(f"{outcome.transform} removed (upstream)")
            continue
        item = seq[i]
        for key, value in outcome.proposal.items():
            item[key] = value
        seq.yaml_set_comment_before_after_key(i, before=f"toolkit upgrade to {short}: MOVED, {outcome.detail}",
                                              indent=_dash(seq, i))
        target.changes.append(f"{outcome.transform} moved: {', '.join(outcome.proposal)}")
    changed = [x for x in layers.values() if x.changes]
    if not changed:
        return []
    texts = {x.path: _dump(x) for x in changed}
    changes = {x.path: x.changes for x in changed}
    if declared.digests:  # the lock the in-image step checks a fetched source against: the new commit's files
        lock = (loaded.path.parent / declared.digests).resolve()
        texts[lock] = json.dumps({p: lf_digest(b) for p, b in new_files.items()}, indent=2, sort_keys=True) + "\n"
        changes[lock] = [f"the digests of {len(new_files)} file(s) at {short}"]
    return _commit(texts, changes, output)


def _dump(layer: _Layer) -> str:
    out = io.StringIO()
    layer.yaml.dump(layer.data, out)
    return out.getvalue()


def _clean_in_git(path: Path) -> str | None:
    """Why git does not vouch for the file as committed and unchanged, or None when it does."""
    try:
        repo = git.Repo(path.parent, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        return "it is not in a git repository"
    try:
        repo.git.ls_files("--error-unmatch", str(path))
    except git.GitCommandError:
        return "git does not track it"
    if repo.git.status("--porcelain", "--", str(path)):
        return "it has uncommitted changes"
    return None


def _commit(texts: dict[Path, str], changes: dict[Path, list[str]], output: Path | None) -> list[Written]:
    if output is not None:
        if len(texts) != 1:
            raise InputError(f"-o {output}: the upgrade changes {len(texts)} files ({', '.join(map(str, texts))}); "
                             "-o takes one", hint="commit the layers and write them in place (no -o)")
        if output.exists():
            raise InputError(f"-o {output}: exists; upgrade writes a new file only",
                             hint="name a path that does not exist yet")
        [(source, text)] = texts.items()
        _atomic(output, text)
        return [Written(output, tuple(changes.get(source, ())))]
    refused = {p: why for p in texts if (why := _clean_in_git(p)) is not None}
    if refused:
        raise InputError("--write: not writing in place: " + "; ".join(f"{p}: {why}" for p, why in refused.items()),
                         hint="commit the file first (the upgrade's diff is then the review), or write to -o FILE")
    for path, text in texts.items():
        _atomic(path, text)
    return [Written(p, tuple(changes.get(p, ()))) for p in texts]


def _atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def describe(written: list[Written]) -> list[str]:
    return [f"wrote {w.path}: {'; '.join(w.changes)}" for w in written] or ["nothing to write"]


