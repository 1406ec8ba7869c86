"""Whether the tree's vLLM serves a checkpoint as a multimodal model, asked of vLLM's own registry in a Python of the
runtime (it imports vLLM: 6-14 s), and remembered by what the answer was read from.

The question's Python records what it read of the tree: every module it imported (the forked registry check imports
the model's module and loads vLLM's plugins; the question does both again in its own process, so their files are
its modules too), every other file it opened (plugin entry points, data a module reads at import) and every folder
it listed (an import lists a folder to find a name in it: a new file there could shadow another). An answer is
reused for a tree whose recorded files have the same bytes and whose recorded folders the same names; a byte of a
file the question never read (a fast path a function imports when it runs, a chat template) asks nothing again.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import ToolkitError
from toolkit.inputs import remember
from toolkit.pyenv import build_key
from toolkit.transforms.files import sha256

QUESTION = '''\
import json
import sys

read, listed = set(), set()


def heard(event, args):
    if event == "open" and isinstance(args[0], str):
        read.add(args[0])
    elif event in ("os.listdir", "os.scandir") and args and isinstance(args[0], str):
        listed.add(args[0])


sys.addaudithook(heard)
from vllm.model_executor.models import ModelRegistry

print(ModelRegistry.is_multimodal_model(sys.argv[1:]), flush=True)
try:  # what the forked check read, read here too; if that fails, the answer stands and is not remembered
    ModelRegistry.resolve_model_cls(sys.argv[1:])
    from vllm.plugins import load_general_plugins

    load_general_plugins()
except Exception:
    print("READ null")
else:
    modules = {getattr(module, "__file__", None) for module in list(sys.modules.values())}
    print("READ " + json.dumps({"files": sorted(f for f in read | modules if isinstance(f, str)),
                                "folders": sorted(listed)}))
'''
RECORDS_KEPT = 16  # answers remembered per question (runtime, architectures, environment): the newest


def _names(folder: Path) -> str | None:
    """A folder's names, but its __pycache__: a run writes one into the tree it imports from, and the next rehearsal's
    fresh copy has none yet (no import finds a module there)."""
    try:
        return sha256("\0".join(sorted(n for n in os.listdir(folder) if n != "__pycache__")).encode())
    except OSError:
        return None


def _file(path: Path) -> str | None:
    try:
        return sha256(path.read_bytes())
    except OSError:
        return None


def _under(path: str, roots: list[Path]) -> str | None:
    """`path` as "INDEX:RELATIVE" under the first root holding it (`roots` resolved; not in a __pycache__: its source
    is the module's own file, recorded as such); None outside every root."""
    real = Path(os.path.realpath(path))
    for index, root in enumerate(roots):
        try:
            rel = real.relative_to(root)
        except ValueError:
            continue
        return None if "__pycache__" in rel.parts else f"{index}:{rel.as_posix()}"
    return None


def _newest_first(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True) if folder.is_dir() else []


def _at(place: str, roots: list[Path]) -> Path:
    index, _, rel = place.partition(":")
    return roots[int(index)] / rel


@dataclass(frozen=True)
class Question:
    """One registry question: the runtime's Python, the architectures, the environment it runs in (PYTHONPATH's
    folders under `roots` are read by what the answer recorded, the rest by name)."""

    python: Path
    architectures: list[str]
    env: dict[str, str]
    roots: list[Path]
    outside: list[str]  # PYTHONPATH's entries that are not roots (the stand-ins' folder: its name has its digest)
    record_env: str  # the variable naming the stand-ins' record, left out of the key

    @property
    def key(self) -> str:
        """What the answers remembered for it share: everything but the roots' content (the stand-ins' record path
        changes with every run and is not read by the answer)."""
        settings = {k: v for k, v in self.env.items() if k not in ("PYTHONPATH", self.record_env)}
        return build_key(str(self.python), self.architectures, sorted(settings.items()), QUESTION, self.outside,
                         len(self.roots))

    def _digests(self, paths: list[str], digest: Callable[[Path], str | None]) -> dict[str, str]:
        """Each path under a root, by place, with its digest now (gone ones left out)."""
        resolved = [Path(os.path.realpath(root)) for root in self.roots]
        places = {p for p in (_under(path, resolved) for path in paths) if p is not None}
        return {p: d for p in sorted(places) if (d := digest(_at(p, self.roots))) is not None}

    def remembered(self, folder: Path) -> bool | None:
        """The answer of a record in `folder` whose files and folders are as they were, or None."""
        for path in _newest_first(folder):
            try:
                record = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                continue
            same = all(_file(_at(place, self.roots)) == digest for place, digest in record["files"].items()) and \
                all(_names(_at(place, self.roots)) == digest for place, digest in record["folders"].items())
            if same:
                return bool(record["multimodal"])
        return None

    def ask(self, rundir: Path, folder: Path, timeout: float, hint: str, located: Callable[[str], str]) -> bool:
        """The answer from a Python of the runtime, remembered in `folder` with what it read."""
        proc = subprocess.run([str(self.python), "-c", QUESTION, *self.architectures], capture_output=True,
                              text=True, env=self.env, cwd=rundir, timeout=timeout)
        lines = proc.stdout.strip().splitlines()
        answer = next((line for line in lines if line in ("True", "False")), None)
        read = next((line for line in lines if line.startswith("READ ")), None)
        if proc.returncode != 0 or answer is None or read is None:
            raise ToolkitError("the tree's vLLM could not say whether it serves the checkpoint as a multimodal "
                               f"model:\n{located(proc.stderr[-3000:])}", hint=hint)
        seen = json.loads(read.removeprefix("READ "))
        if seen is None:
            return answer == "True"
        files = self._digests(seen["files"], _file)
        folders = self._digests(seen["folders"], _names)
        if not files:  # the tree's vLLM was not read from the roots: nothing says which tree the answer holds for
            return answer == "True"
        record = {"multimodal": answer == "True", "files": files, "folders": folders}
        text = json.dumps(record, indent=1)
        remember(folder / f"{sha256(text.encode())[:16]}.json", text)
        for old in _newest_first(folder)[RECORDS_KEPT:]:
            old.unlink(missing_ok=True)  # records this cache wrote; the oldest go
        return answer == "True"
