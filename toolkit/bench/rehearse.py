"""The server the platform starts, as its run config says, on the CPU runtime: the run config's own argv and env
with only the substitutions a CPU and a tiny model need, each one recorded (what the run config says, what runs
instead, why). The base of `toolkit rehearse` (the submission's own server command answering the
official requests before any GPU sees it): the checks on top are not built yet."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from toolkit.bench import experiment

# the tiny model's lengths: its config allows 4096 positions; 1024 keeps the KV cache of the emulated card small
MAX_MODEL_LEN = 1024
# below the rehearsal's prompt lengths, so a prefill is chunked and runs beside decodes, as on the platform
BATCH_TOKENS = 256


@dataclass(frozen=True)
class Substitution:
    flag: str
    served: str | None  # what the run config says (None: it says nothing)
    rehearsed: str
    why: str


def server_command(run_config: str, python: Path, model: Path, port: int, tp: int,
                   rootfs: Path | None = None) -> tuple[list[str], dict[str, str], list[Substitution]]:
    """The run config's argv and env with the rehearsal's substitutions: this machine's Python, the tiny model,
    loopback and a free port (as `toolkit experiment` starts a variant), `tp`, lengths scaled to the tiny model, and
    each absolute path the argv names that the recipe deployed into `rootfs` (the chat template) read from there.
    Everything else is the run config's."""
    served = [str(item) for item in (yaml.safe_load(run_config).get("command") or [])]
    argv, env = experiment.server_command(run_config, python, model, port)
    subs = [Substitution("python3", served[0], str(python), "the CPU runtime's Python")]
    chunked = "--enable-chunked-prefill" in argv
    for flag, value, why in [
            ("--model", str(model), "the tiny model of the recipe's architecture"),
            ("--host", "127.0.0.1", "never listen beyond this machine"),
            ("--port", str(port), "a free port"),
            ("--tensor-parallel-size", str(tp), f"TP {tp} on this CPU"),
            ("--max-model-len", str(MAX_MODEL_LEN), "the tiny model's length"),
            ("--max-num-batched-tokens", str(BATCH_TOKENS if chunked else MAX_MODEL_LEN),
             "scaled to the tiny model" + (": prefills are chunked" if chunked else ""))]:
        argv = experiment.set_flag(argv, flag, value)
        if experiment.flag_value(served, flag) != value:
            subs.append(Substitution(flag, experiment.flag_value(served, flag), value, why))
    if rootfs is not None:
        for index, item in enumerate(argv):
            deployed = rootfs / item.lstrip("/")
            if index > 0 and item.startswith("/") and argv[index - 1].startswith("--") and deployed.is_file():
                argv[index] = str(deployed)
                subs.append(Substitution(argv[index - 1], item, str(deployed), "the file the recipe deployed there"))
    return argv, env, subs
