"""The flagship's server as the platform starts it, on a CPU (`pytest -k served_api`): the run config's own argv
and env (toolkit/bench/rehearse.py: only the recorded substitutions), vLLM 0.6.3's OpenAI server over the
CoreX-like tree patched by the flagship with the stand-in adapter, its engine process, a second TP rank, the vendor's
GPU path on CPU tensors and the tiny checkpoint; a streamed chat request through the toolkit's bench client.

The start of `toolkit rehearse` (issue 31): its checks (the official requests, the parsers, the prefix cache) are
to run on top of this.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import yaml
from conftest import FLAGSHIP
from test_generate_flagship import flagship  # noqa: F401  (the fixture: the patched tree, the tiny model)

from toolkit.bench import client, rehearse
from toolkit.bench.experiment import OFFLINE_ENV
from toolkit.bench.serve import Server, free_port, stray_processes
from toolkit.recipe import load_recipe
from toolkit.submission.render import render

TEMPLATE = "/opt/toolkit/chat_templates/qwen36_multi_system.jinja"


def test_the_substitutions_are_recorded_and_nothing_else_changes(tmp_path: Path) -> None:
    loaded = load_recipe(FLAGSHIP)
    run_config = render(loaded.recipe, loaded.path.name, "base").run_config
    (tmp_path / TEMPLATE.lstrip("/")).parent.mkdir(parents=True)
    (tmp_path / TEMPLATE.lstrip("/")).write_text("{{ messages }}")
    argv, env, subs = rehearse.server_command(run_config, Path("/py"), Path("/tiny"), 8123, 2, tmp_path)
    said = {s.flag: (s.served, s.rehearsed) for s in subs}
    assert said == {"python3": ("python3", "/py"), "--model": ("/model", "/tiny"), "--host": ("0.0.0.0", "127.0.0.1"),
                    "--port": ("8000", "8123"), "--tensor-parallel-size": ("4", "2"),
                    "--max-model-len": ("245000", str(rehearse.MAX_MODEL_LEN)),
                    "--max-num-batched-tokens": ("16384", str(rehearse.BATCH_TOKENS)),
                    "--chat-template": (TEMPLATE, str(tmp_path / TEMPLATE.lstrip("/")))}
    # every other item of the argv is the run config's, in its place
    served = [str(item) for item in yaml.safe_load(run_config)["command"]]
    assert len(argv) == len(served)
    differ = {(argv[i - 1] if i else "python3"): (served[i], argv[i]) for i in range(len(argv)) if argv[i] != served[i]}
    assert differ == said
    assert env["HYBRID_KV_ACCOUNTING"] == "full_attention" and env["PREFIX_STATE_INTERVAL"] == "4096"


def test_the_flagships_server_answers_a_streamed_chat_request_at_tp2(flagship: dict[str, Any]) -> None:  # noqa: F811
    loaded = load_recipe(FLAGSHIP)
    run_config = render(loaded.recipe, loaded.path.name, "base").run_config
    port = free_port()
    argv, env, subs = rehearse.server_command(run_config, flagship["python"], flagship["model"], port, 2,
                                              flagship["rootfs"])
    assert "--chat-template" in {s.flag for s in subs}  # the deployed template, not the image's path
    work = flagship["work"]
    server = Server(argv, {**flagship["env"], **OFFLINE_ENV, **env}, cwd=work, log_path=work / "server.log",
                    url=f"http://127.0.0.1:{port}", model="llm")
    server.start()
    try:
        server.wait_ready(600)
        settings = client.Settings(server.url, model="llm", max_tokens=8, ignore_eos=True, timeout_s=300)
        conversation = client.Conversation("short", [client.Turn("Say hello in one word.")], system="Be brief.")
        records, _ = asyncio.run(client.run([conversation], settings, 1))
    finally:
        server.stop()
    [record] = records
    assert record.ok and record.status == 200, (record.failure, record.message, server.log_tail(60))
    assert record.completion_tokens == 8 and record.prompt_tokens > 0 and record.content_times
    log = server.log_path.read_text(encoding="utf-8", errors="replace")
    assert "VllmWorkerProcess" in log  # the second rank ran in its own process
    assert stray_processes() == [], "the server's group (engine process, TP worker) was stopped"
