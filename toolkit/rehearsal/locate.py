"""Where a failed start or a failed request failed: the first real error in a server's log, each of its frames inside
the patched tree as file:line, and the transform that wrote that line."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from toolkit.markers import read_markers
from toolkit.runtime.preflight import Tree

FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def _writer(tree: Tree, path: Path, lineno: int, whole: frozenset[str]) -> str | None:
    """The transform that wrote line `lineno` of `path`: the file's steps replayed in order, each line carried
    through the lines a step kept and credited to the step that brought it in; every line of a file a `whole`
    transform put in place (a deploy replacing the vendor's file) is that transform's, even one the vendor's file
    also had. For roots patched beforehand (no steps): the transforms whose markers the file carries."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    if not 0 < lineno <= len(lines) or not lines[lineno - 1].strip():
        return None
    target = path.resolve()
    steps = [step for where, step in tree.steps if where.resolve() == target]
    if not steps:
        marked = read_markers("\n".join(lines))
        return f"a file edited by {', '.join(marked)}" if marked else None
    credit: list[str | None] = [None] * len(steps[0].before.splitlines())
    for step in steps:
        before, after = step.before.splitlines(), step.after.splitlines()
        if step.transform in whole or len(credit) != len(before):
            credit = [step.transform] * len(after)
            continue
        carried: list[str | None] = []
        for op, b0, b1, a0, a1 in difflib.SequenceMatcher(None, before, after, autojunk=False).get_opcodes():
            carried += credit[b0:b1] if op == "equal" else [step.transform] * (a1 - a0)
        credit = carried
    # a file changed since its steps were planned: no line can be credited
    return credit[lineno - 1] if len(credit) == len(lines) else None


RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")
# what argparse prints before it exits 2: `PROG: error: MESSAGE` (after its usage lines)
ARGPARSE_ERROR = re.compile(r"^[\w.-]+(?:\.py)?: error: ")
ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt|Exit)\b:?")
# what the API server raises when its engine process died: the engine's own traceback, earlier, is the cause
WRAPPERS = ("Engine process failed to start", "Caught handled exception")


def _blocks(lines: list[str]) -> list[tuple[str, list[re.Match[str]]]]:
    """Each traceback in a log: the error it ended in, and its frames."""
    out: list[tuple[str, list[re.Match[str]]]] = []
    for start, line in enumerate(lines):
        if "Traceback (most recent call last)" not in line:
            continue
        frames, error = [], ""
        for follow in lines[start + 1:]:
            # a worker's lines carry a prefix before the traceback's own text (`(VllmWorkerProcess pid=..) ERROR ...]
            # `, and torch's `[rank0]: ` on every line of an in-process engine's error)
            text = RANK_PREFIX.sub("", follow, count=1)
            text = text.split("] ", 1)[1] if text.startswith(("ERROR", "(", "\x1b")) and "] " in text else text
            if (match := FRAME.match(text)) is not None:
                frames.append(match)
            elif ERROR_LINE.match(text):
                error = text.strip()
                break
            elif not text.startswith((" ", "\t")) and frames:
                break
        out.append((error or "(the traceback ended without its error line)", frames))
    return out


def locate(log: str, tree: Tree, whole: frozenset[str] = frozenset()) -> str:
    """The cause of a failed start, from a server's log: the first traceback that is not the server reporting its
    engine's death, each of its frames inside the patched trees as file:line (and the transform that wrote the line,
    where one did; `whole`: the transforms that put whole files in place), and the error it ended in."""
    refused = [line.strip() for line in log.splitlines() if ARGPARSE_ERROR.match(line.strip())]
    if refused:
        usage = next((line.strip() for line in log.splitlines() if line.startswith("usage: ")), "")
        return (f"the server refused its argv (argparse): {refused[-1]}"
                + (f" [{usage[:160]}{'...' if len(usage) > 160 else ''}]" if usage else ""))
    blocks = _blocks(log.splitlines())
    if not blocks:
        errors = [line.strip() for line in log.splitlines() if ERROR_LINE.match(line.strip())]
        return errors[-1] if errors else "(no traceback in the log)"
    error, frames = next((b for b in blocks if not any(w in b[0] for w in WRAPPERS)), blocks[-1])
    shown = []
    for match in frames:
        path = Path(match["file"])
        root = next((p for p in tree.paths if path.is_relative_to(p)), None)
        if root is None:
            continue
        writer = _writer(tree, path, int(match["line"]), whole)
        shown.append(f"  {path.relative_to(root).as_posix()}:{match['line']} in {match['func']}"
                     + (f"  (written by {writer})" if writer else ""))
    last = blocks[-1][0]
    return "\n".join([error, *(["inside the patched tree:", *shown[-6:]] if shown else []),
                      *([f"then: {last}"] if last != error else [])])
