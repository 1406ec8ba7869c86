"""Our client against `vllm bench serve` on the same CPU server, same load: output throughput and TTFT P50.

Starts the cached CPU test server (tests/recipes/cpu-server.yaml, tiny model), runs `vllm bench serve` (random
prompts of about the same length, fixed output length, ignore_eos) and `toolkit bench` (short prompts), each at
concurrency 1 and 4, alternating, and prints each pair with its ratio (ours / vLLM's). TTFT is compared twice: ours
as the evaluator defines it (first content event) and ours read by vLLM's definition (first chunk with choices, the
role-only one), each against vLLM's.

The server's engine process is moved beside its bound worker and both clients run on the cores left over: otherwise
the engine's busy-wait starves the API server in phases and both clients see whole streams in one burst (see
`cpu_server.engine_beside_worker`); the comparison is of the clients, so the server must not be bimodal.

    python benchmarks/bench_vs_vllm.py [--requests 16] [--output-len 128]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from toolkit.bench import cpu_server  # noqa: E402
from toolkit.bench.experiment import OFFLINE_ENV, server_command  # noqa: E402
from toolkit.bench.metrics import percentile  # noqa: E402
from toolkit.bench.serve import Server, free_port  # noqa: E402
from toolkit.recipe import load_recipe  # noqa: E402
from toolkit.submission.render import render  # noqa: E402


def pin(cores: set[int] | None) -> list[str]:
    """Both clients on the cores the server left free (vLLM-CPU binds its compute worker to a core; a client
    sharing that core is starved and reads whole streams in one burst at the end)."""
    return ["taskset", "-c", ",".join(map(str, sorted(cores)))] if cores else []


WRAPPER = ("import argparse; from vllm.benchmarks.serve import add_cli_args, main; "
           "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args())")


def vllm_bench(cores: set[int] | None, python: Path, url: str, model: Path, requests: int, output_len: int,
               concurrency: int, folder: Path, input_len: int = 24) -> dict[str, float]:
    cmd = [*pin(cores), str(python), "-c", WRAPPER, "--backend", "openai-chat", "--base-url", url, "--endpoint",
           "/v1/chat/completions", "--model", "llm", "--tokenizer", str(model), "--dataset-name", "random",
           "--random-input-len", str(input_len), "--random-output-len", str(output_len), "--num-prompts", str(requests),
           "--max-concurrency", str(concurrency), "--ignore-eos", "--save-result", "--result-dir", str(folder),
           "--result-filename", "vllm.json", "--disable-tqdm"]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, **OFFLINE_ENV})
    data = json.loads((folder / "vllm.json").read_text())
    return {"output_throughput": data["output_throughput"], "ttft_p50_ms": data["median_ttft_ms"],
            "prompt_tokens": data["total_input_tokens"] / data["completed"]}


def ours(cores: set[int] | None, url: str, requests: int, output_len: int, concurrency: int,
         folder: Path) -> dict[str, float]:
    """`toolkit bench` in a process of its own, as vLLM's client runs in one (salted: cold like random prompts)."""
    out = folder / f"ours-{uuid.uuid4().hex[:8]}"
    subprocess.run([*pin(cores), sys.executable, "-m", "toolkit.cli", "bench", url, "--requests", str(requests),
                    "--max-tokens", str(output_len), "--ignore-eos", "--concurrency", str(concurrency), "-o", str(out),
                    "--json"], check=True, capture_output=True, cwd=ROOT)
    summary = json.loads((out / f"c{concurrency}" / "summary.json").read_text())
    assert summary["success_rate"] == 1.0, summary
    records = [json.loads(line) for line in (out / f"c{concurrency}" / "requests.jsonl").read_text().splitlines()]
    # vLLM's client stops its TTFT clock at the first chunk with choices (the role-only one); ours at the first
    # content, as the evaluator does: the same records read by vLLM's definition, for a like-for-like row
    first_chunk = percentile([r["chunk_times"][0] * 1000 for r in records], 50)
    return {"output_throughput": summary["output_tps_agg"], "ttft_p50_ms": summary["ttft_p50_ms"],
            "first_chunk_p50_ms": first_chunk or 0.0,
            "prompt_tokens": summary["total_prompt_tokens"] / summary["requests"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    python = cpu_server.environment()
    model = cpu_server.tiny_model(python)
    recipe_path = ROOT / "tests" / "recipes" / "cpu-server.yaml"
    loaded = load_recipe(recipe_path)
    port = free_port()
    argv, env = server_command(render(loaded.recipe, recipe_path.name, None).run_config, python, model, port)
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(argv, {**os.environ, **OFFLINE_ENV, **env}, Path(tmp), Path(tmp) / "server.log",
                        f"http://127.0.0.1:{port}")
        server.start()
        try:
            server.wait_ready(300)
            assert server.process is not None
            moved = cpu_server.engine_beside_worker(server.process.pid)
            cores = server.client_cores()
            print(f"engine process {moved or 'not moved'} beside the worker; clients on cores "
                  f"{sorted(cores) if cores else 'any'}")
            # warm-ups, which also size vLLM's random prompts to ours (its template adds tokens to the 24 asked)
            overhead = vllm_bench(cores, python, server.url, model, 4, 16, 1, Path(tmp))["prompt_tokens"] - 24
            ours_prompt = ours(cores, server.url, 4, 16, 1, Path(tmp))["prompt_tokens"]
            input_len = max(1, round(ours_prompt - overhead))
            print(f"prompt tokens per request: toolkit {ours_prompt:.1f}; vllm bench --random-input-len {input_len} "
                  f"(+{overhead:.0f} of its template)")
            print(f"{'concurrency':>11} {'metric':18} {'toolkit':>10} {'vllm bench':>11} {'ratio':>6}")
            for concurrency in (1, 4):
                mine: list[dict[str, float]] = []
                theirs: list[dict[str, float]] = []
                for _ in range(args.rounds):  # alternating, so drift in the machine's load hits both
                    theirs.append(vllm_bench(cores, python, server.url, model, args.requests, args.output_len,
                                             concurrency, Path(tmp), input_len))
                    mine.append(ours(cores, server.url, args.requests, args.output_len, concurrency, Path(tmp)))
                rows = (("output_throughput", "output_throughput"), ("ttft_p50_ms", "ttft_p50_ms"),
                        ("first_chunk_p50_ms", "ttft_p50_ms"))  # ours by vLLM's definition, against vLLM's TTFT
                for mine_key, their_key in rows:
                    a = sum(m[mine_key] for m in mine) / len(mine)
                    b = sum(t[their_key] for t in theirs) / len(theirs)
                    print(f"{concurrency:11d} {mine_key:18} {a:10.2f} {b:11.2f} {a / b:6.2f}")
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
