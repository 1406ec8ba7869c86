"""What the adapter's deployed endpoints need from the server's argv: the engine client the argv selects must have
every method they call (lint's engine-client rule, read with libcst from the adapter's pinned files and vLLM
0.6.3's own), and a deploy's declared flags must be passed (deploy-needs-arg)."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pinned_adapter
import pytest
import yaml
from conftest import REPO, flagship_data

from toolkit.commands.common import Inputs, pinned
from toolkit.lint import lint
from toolkit.lint.engine_client import class_members, client_uses, unsupported_config
from toolkit.recipe import load_recipe
from toolkit.results import Severity

pytestmark = pytest.mark.usefixtures("vllm_063")  # the classes are read from vLLM 0.6.3's source


def _recipe(tmp_path: Path, args: dict[str, Any] | None = None, drop: tuple[str, ...] = ()) -> Path:
    data = copy.deepcopy(flagship_data())
    data["patches"] = str(REPO / "patches" / "src")
    for flag in drop:
        data["serve"]["args"].pop(flag)
    data["serve"]["args"].update(args or {})
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _issues(path: Path, adapter: tuple[Path, str] | None, rule: str) -> list[Any]:
    loaded = load_recipe(path)
    if adapter is not None:
        loaded, _ = pinned(loaded, Inputs({"qwen36-adapter": f"{adapter[0]}@{adapter[1]}"}))
    return [i for i in lint(loaded).issues if i.rule == rule]


def test_the_flagship_passes_the_front_end_its_chat_endpoint_needs(tmp_path: Path,
                                                                   adapter: tuple[Path, str]) -> None:
    path = _recipe(tmp_path)
    assert _issues(path, adapter, "engine-client") == [] and _issues(path, adapter, "deploy-needs-arg") == []


def test_without_the_flag_lint_names_the_call_the_class_and_the_flag(tmp_path: Path,
                                                                     adapter: tuple[Path, str]) -> None:
    path = _recipe(tmp_path, drop=("disable-frontend-multiprocessing",))
    [issue] = _issues(path, adapter, "engine-client")
    line = next(n for n, text in enumerate(pinned_adapter.source_file("serving_chat.py").decode().splitlines(), 1)
                if "get_scheduler_config()" in text)
    assert issue.severity is Severity.ERROR
    assert f"vllm/entrypoints/openai/serving_chat.py:{line} (@qwen36-adapter/serving_chat.py" in issue.message
    assert "engine_client.get_scheduler_config, which MQLLMEngineClient" in issue.message
    assert "adapter-replace-serving-chat" in issue.message and "HTTP 500" in issue.message
    assert "--disable-frontend-multiprocessing" in issue.fix
    [declared] = _issues(path, adapter, "deploy-needs-arg")
    assert "needs --disable-frontend-multiprocessing: its n > max_num_seqs guard" in declared.message
    assert declared.origin is not None and declared.origin.file == str(path)


def test_pipeline_parallel_selects_the_in_process_engine_as_vllm_does(tmp_path: Path,
                                                                      adapter: tuple[Path, str]) -> None:
    """MQLLMEngineClient.is_unsupported_config (pipeline parallel > 1, read from vLLM's source) gives the endpoints
    an AsyncLLMEngine, which has get_scheduler_config: the structural rule is quiet, the declared need is not."""
    path = _recipe(tmp_path, {"pipeline-parallel-size": 2}, drop=("disable-frontend-multiprocessing",))
    assert _issues(path, adapter, "engine-client") == []
    assert len(_issues(path, adapter, "deploy-needs-arg")) == 1


def test_without_the_adapter_here_the_check_says_it_was_not_made(tmp_path: Path) -> None:
    [issue] = _issues(_recipe(tmp_path), None, "engine-client")
    assert issue.severity is Severity.INFO and "not checked: source qwen36-adapter is not found here" in issue.message


def test_the_readers_on_vllm_063(vllm_063: Path) -> None:
    client = (vllm_063 / "vllm/engine/multiprocessing/client.py").read_text()
    engine = (vllm_063 / "vllm/engine/async_llm_engine.py").read_text()
    mq, local = class_members(client, "MQLLMEngineClient"), class_members(engine, "AsyncLLMEngine")
    assert mq is not None and local is not None
    # methods, properties and what __init__ assigns to self
    assert {"generate", "errored", "dead_error", "get_tokenizer", "beam_search", "context"} <= mq
    assert "get_scheduler_config" in local and "get_scheduler_config" not in mq
    # upstream's own endpoints call only what the default front end has
    for rel in ("serving_chat.py", "serving_completion.py", "serving_embedding.py", "serving_tokenization.py"):
        uses = client_uses((vllm_063 / "vllm/entrypoints/openai" / rel).read_text())
        assert uses and {u.name for u in uses} <= mq, rel
    assert unsupported_config(client, {"pipeline_parallel_size": 2}.get) is True
    assert unsupported_config(client, {"pipeline_parallel_size": 1}.get) is False


def test_a_pinned_file_changed_by_one_byte_is_named(tmp_path: Path) -> None:
    copy_of = tmp_path / "pin"
    shutil.copytree(pinned_adapter.require().parent, copy_of)
    assert pinned_adapter.check_copy(copy_of)
    target = copy_of / "qwen3_6_scripts" / "serving_chat.py"
    data = bytearray(target.read_bytes())
    data[100] ^= 1
    target.write_bytes(bytes(data))
    with pytest.raises(pinned_adapter.PinMismatch, match=r"serving_chat.py is not the pin's file: its git blob id"):
        pinned_adapter.check_copy(copy_of)
    target.unlink()
    with pytest.raises(pinned_adapter.PinMismatch, match=r"serving_chat.py is missing \(.*BLOBS.txt:\d+ lists it\)"):
        pinned_adapter.check_copy(copy_of)
