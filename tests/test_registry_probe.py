"""Whether the tree's vLLM serves a checkpoint as multimodal is asked of its own registry in a Python that imports vLLM
(6-14 s a rehearsal); the answer is remembered with what it read of the tree (the files it imported or opened, the
folders it listed), and asked again when one of them changes, not when a file it never read does. Real vLLM 0.6.3
(the CoreX-like reference tree), the real CPU runtime."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

from conftest import REPO

from toolkit.bench import experiment
from toolkit.inputs import cache_dir
from toolkit.recipe import load_recipe
from toolkit.rehearsal import model, servers
from toolkit.runtime import preflight
from toolkit.runtime.env import runtime
from toolkit.submission.render import render

SECOND = REPO / "recipes" / "bi100-qwen25.yaml"


def _stage(tmp_path: Path, tree: preflight.Tree, checkpoint: Path, name: str) -> servers.Stage:
    loaded = load_recipe(SECOND)
    rundir = tmp_path / name
    rundir.mkdir()
    run_config = render(loaded.recipe, SECOND.name, "base").run_config
    return servers.Stage(loaded.recipe, run_config, tree, runtime(), checkpoint, 1, rundir, None, 2.0,
                         lambda _: None, model.Rehearsal("base", 1, rundir))


def _asked(stage: servers.Stage) -> bool:
    """Whether the answer came from a Python of the runtime: its stand-ins wrote their record at its exit."""
    return (stage.rundir / "registry-standins" / "standins.json").is_file()


def _records(stage: servers.Stage) -> list[dict[str, object]]:
    """The answers remembered for the stage's question (the cache's files, written by the asking)."""
    _, env = experiment.server_command(stage.run_config, stage.python, stage.model, 0)
    full_env, _ = servers.server_environment(stage, env, stage.rundir / "probe.json", {}, "registry")
    config = json.loads((stage.model / "config.json").read_text())
    key = servers.registry_question(stage.python, full_env, config).key
    return [json.loads(p.read_text()) for p in (cache_dir() / "registry" / key).glob("*.json")]


def test_the_registrys_answer_is_remembered_until_a_file_it_read_changes(tmp_path: Path) -> None:
    tree = preflight.patched_copy(load_recipe(SECOND), {}, tmp_path / "work")
    # a name no earlier run has seen, in a folder every import of vllm lists: the first question below is asked
    # whatever the cache holds
    (tree.vendor / "vllm" / f"_toolkit_test_{uuid.uuid4().hex}.py").write_text("")
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"architectures": ["ChameleonForConditionalGeneration"],
                                                        "vision_config": {}}))
    # bytecode as a run that imports from the tree writes it (whatever PYTHONDONTWRITEBYTECODE says here)
    (tree.vendor / "vllm" / "__pycache__").mkdir(exist_ok=True)
    (tree.vendor / "vllm" / "__pycache__" / "unused.cpython-311.pyc").write_bytes(b"")
    first = _stage(tmp_path, tree, checkpoint, "first")
    assert first.multimodal() is True and _asked(first)  # vLLM 0.6.3 registers Chameleon as multimodal
    # the bytecode in the folders it listed is gone, as in the next rehearsal's fresh copy
    for cache in sorted(tree.vendor.rglob("__pycache__")):
        shutil.rmtree(cache)
    again = _stage(tmp_path, tree, checkpoint, "again")
    assert again.multimodal() is True and not _asked(again)
    records = [r for r in _records(again) if "0:vllm/model_executor/models/chameleon.py" in r["files"]]
    # a file the question never read: the server reads it when a request comes, the registry never imports it
    unread = "vllm/entrypoints/openai/serving_chat.py"
    assert records and all(f"0:{unread}" not in r["files"] for r in records), "the test needs a file never read"
    (tree.vendor / unread).write_text((tree.vendor / unread).read_text() + "\n# changed\n")
    untouched = _stage(tmp_path, tree, checkpoint, "untouched")
    assert untouched.multimodal() is True and not _asked(untouched)
    # another architecture is another question
    (checkpoint / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "vision_config": {}}))
    text_only = _stage(tmp_path, tree, checkpoint, "text-only")
    assert text_only.multimodal() is False and _asked(text_only)
    # one byte of a file it read changed: asked again
    registry = tree.vendor / "vllm" / "model_executor" / "models" / "registry.py"
    registry.write_text(registry.read_text() + "\n# changed\n")
    changed = _stage(tmp_path, tree, checkpoint, "changed")
    assert changed.multimodal() is False and _asked(changed)
    # a new file in a folder it listed (a module of that name would now be found there): asked again
    (tree.vendor / "vllm" / "model_executor" / "models" / "shadow.py").write_text("")
    listed = _stage(tmp_path, tree, checkpoint, "listed")
    assert listed.multimodal() is False and _asked(listed)
