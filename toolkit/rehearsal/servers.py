"""The rehearsal's servers: the run config's own server command with the printed substitutions a CPU and a tiny
model need, and the comparison servers' changes; each one started, read and stopped whole."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from packaging.version import Version

from toolkit.bench import experiment
from toolkit.bench.serve import Server, free_port, port_in_use
from toolkit.errors import ToolkitError
from toolkit.inputs import cache_dir
from toolkit.lint.context import (
    AUTO_CHUNKED_ABOVE,
    chunked_prefill_effective,
    explicit_chunked_prefill,
    images_per_prompt,
)
from toolkit.recipe import ArgValue, Recipe
from toolkit.rehearsal.locate import locate
from toolkit.rehearsal.model import (
    BATCH_TOKENS,
    COMPARED_DTYPE,
    MAX_MODEL_LEN,
    MULTIMODAL_BATCH_TOKENS,
    SEVERAL_IMAGES,
    SEVERAL_IMAGES_BATCH_TOKENS,
    START_TIMEOUT_S,
    SWAP_SPACE_GB,
    TOKEN_IDS_FLAG,
    Check,
    Rehearsal,
    Substitution,
)
from toolkit.rehearsal.registry import Question
from toolkit.runtime import standins
from toolkit.runtime.preflight import Tree, emulated_devices

Say = Callable[[str], None]
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # passed through from the caller
SERVER_ERROR_WAIT_S = 10.0  # how long a 5xx's traceback may take to reach the server's log


@dataclass(frozen=True)
class ServerSpec:
    """One server a check may need: the run config's, or one of the comparison servers (another dtype, the cache
    switched, token ids, another TP), with what it changes said as substitutions."""

    name: str
    prefix_caching: bool | None = None  # None: as the run config says
    dtype: str | None = None  # None: the run config's
    flags: tuple[str, ...] = ()
    tp: int | None = None  # None: the rehearsal's
    substitutions: tuple[Substitution, ...] = ()
    text_only: bool = False  # its requests are text: a model with a vision tower starts it with no image per prompt

    @property
    def label(self) -> str:
        return f"{self.name} server ({self.dtype})" if self.dtype else f"{self.name} server"


COMPARED = (
    Substitution("--dtype (comparison servers)", None, COMPARED_DTYPE, "in bf16 how a prefill is chunked and batched "
                 "changes its rounding, and through the MoE router that changes tokens"),
    Substitution(f"{TOKEN_IDS_FLAG} (comparison servers)", None, "on", "their answers are compared token by token, by "
                 "id: of the tiny model's ids many print as no text"),
    Substitution("--enable-prefix-caching (comparison servers)", "as the run config says", "on for one, off for the "
                 "others", "the cache must change no token"),
    Substitution("stream (comparison requests)", "true", "false", "a whole answer carries every token's logprob; a "
                 "stream leaves out the deltas a reasoning parser holds back (a token that decodes to no text)"),
)
# the answers check's reference run: the same tree and checkpoint on one rank
TP1 = Substitution("--tensor-parallel-size (the answers' reference server)", "the rehearsed TP", "1",
                   "the answers at TP N must equal one rank's: a reduction, a shard or a replicated KV head gone wrong "
                   "changes them")
# the answers check's reference run with the recipe's own code out of the way
PATHS_OFF = Substitution("fast paths (the answers' fast-paths-off server)", "as the run config switches them",
                         "off, at TP 1", "the answers must equal the adapter's own code's: a fast path that is wrong "
                         "alike in prefill and decode, at every TP, changes them")
# what the comparison servers of a multimodal model change beyond COMPARED
TEXT_ONLY = Substitution("--limit-mm-per-prompt (comparison servers)", "1 image (vLLM's default)",
                         f"image=0, and --max-num-batched-tokens {BATCH_TOKENS}",
                         "their requests are text; the served server starts with the image profile "
                         f"({MULTIMODAL_BATCH_TOKENS}-token chunks), they with the small chunks the oracles' prompts "
                         "are chunked by")
# the one registry of servers, in the order a rehearsal starts them (each once)
SERVERS = {spec.name: spec for spec in (
    ServerSpec("served"),
    ServerSpec("cache-on", True, COMPARED_DTYPE, (TOKEN_IDS_FLAG,), substitutions=COMPARED, text_only=True),
    ServerSpec("cache-off", False, COMPARED_DTYPE, (TOKEN_IDS_FLAG,), substitutions=COMPARED, text_only=True),
    ServerSpec("tp1", False, COMPARED_DTYPE, (TOKEN_IDS_FLAG,), tp=1, substitutions=(*COMPARED, TP1),
               text_only=True),
    ServerSpec("paths-off", False, COMPARED_DTYPE, (TOKEN_IDS_FLAG,), tp=1, substitutions=(*COMPARED, PATHS_OFF),
               text_only=True),
)}


def _flag_given(argv: list[str], flag: str) -> ArgValue:
    """A flag as the recipe's args say it: its value, True for a bare switch, None when absent."""
    if flag not in argv:
        return None
    return experiment.flag_value(argv, flag) or True


def auto_chunks(tree: Tree) -> bool:
    """Whether the tree's vLLM still turns chunked prefill on by itself above 32K (a transform may take that out:
    then only the flag decides)."""
    for root in tree.paths:
        source = root / "vllm/engine/arg_utils.py"
        if source.is_file():
            return "Chunked prefill is enabled by default for models with" in source.read_text(encoding="utf-8")
    return True


def argv_of(run_config: str) -> list[str]:
    """The run config's argv, as the platform runs it."""
    return [str(item) for item in (yaml.safe_load(run_config).get("command") or [])]


def server_command(run_config: str, python: Path, model: Path, port: int, tp: int, rootfs: Path | None = None,
                   version: str = "0.6.3", auto_chunk: bool = True, batch_tokens: int = BATCH_TOKENS
                   ) -> tuple[list[str], dict[str, str], list[Substitution]]:
    """The run config's argv and env with the rehearsal's substitutions: this machine's Python, the tiny model,
    loopback and a free port (as `toolkit experiment` starts a variant), `tp`, lengths scaled to the tiny model, and
    each absolute path the argv names that the recipe deployed into `rootfs` (the chat template) read from there.
    Chunked prefill as vLLM `version` decides it for the served argv (`auto_chunk`: the tree still turns it on
    above 32K), said explicitly where the tiny length would not trigger it, in chunks of `batch_tokens`. Everything
    else is the run config's."""
    served = argv_of(run_config)
    argv, env = experiment.server_command(run_config, python, model, port)
    subs = [Substitution("python3", served[0], str(python), "the CPU runtime's Python")]
    flag = "--enable-chunked-prefill"
    given = _flag_given(served, flag)
    max_len = experiment.flag_value(served, "--max-model-len")
    chunked = chunked_prefill_effective(given, int(max_len) if max_len else None, Version(version), auto=auto_chunk)
    if chunked and explicit_chunked_prefill(given) is None:
        argv.append(flag)
        subs.append(Substitution(flag, None, "on", f"vLLM {version} turns chunked prefill on by itself for the "
                                 f"served --max-model-len {max_len} (> {AUTO_CHUNKED_ABOVE}); the tiny model's "
                                 f"{MAX_MODEL_LEN} would not"))
    for flag, value, why in [
            ("--model", str(model), "the rehearsal's checkpoint: the tiny model of the recipe's architecture, "
             "or the one --model names"),
            ("--host", "127.0.0.1", "never listen beyond this machine"),
            ("--port", str(port), "a free port"),
            ("--tensor-parallel-size", str(tp), f"TP {tp} on this CPU"),
            ("--max-model-len", str(MAX_MODEL_LEN), "the tiny model's length"),
            ("--max-num-batched-tokens", str(batch_tokens if chunked else MAX_MODEL_LEN),
             "scaled to the tiny model" + (": prefills are chunked" if chunked else "")),
            # each rank allocates and zeroes its swap blocks in this machine's memory (4 GiB by default: about
            # 20 s of a start and 8 GiB at TP 2); only a preempted group of several sequences swaps
            ("--swap-space", str(SWAP_SPACE_GB), "the CPU swap blocks scaled to the emulated card")]:
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



def registry_question(python: Path, env: dict[str, str], config: dict[str, Any]) -> Question:
    """The registry question of a server's environment: the runtime, the architectures, the environment; the folders
    on PYTHONPATH (the patched tree, whatever the run config adds) are compared by what an answer read of them, the
    stand-ins' folder by its name, which carries its content's digest."""
    paths = [Path(entry) for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    cache = cache_dir()
    roots = [p for p in paths if p.is_dir() and not p.is_relative_to(cache)]
    return Question(python, list(config["architectures"]), env, roots, [str(p) for p in paths if p not in roots],
                    standins.RECORD_ENV)


@dataclass
class Stage:
    """What every server of one rehearsal shares."""

    recipe: Recipe
    run_config: str
    tree: Tree
    python: Path
    model: Path
    tp: int
    rundir: Path
    image: Path | None
    memory_gb: float
    say: Say
    rehearsal: Rehearsal
    ready_at: dict[Path, int] = field(default_factory=dict)  # each server log's size when the server was ready
    multimodal_seen: bool | None = None  # what the tree's vLLM said of the checkpoint's architecture, once asked

    def multimodal(self) -> bool:
        """Whether the tree's vLLM serves the checkpoint as a multimodal model (it then profiles an image at start
        and takes --limit-mm-per-prompt; a config's vision tower alone does not say: the adapter at 5a1c8c7 skips
        it). Asked of vLLM's own registry in the runtime, with a server's environment, once."""
        if self.multimodal_seen is None:
            config = json.loads((self.model / "config.json").read_text(encoding="utf-8"))
            if "vision_config" not in config:  # no tower: nothing to profile, whatever the class says
                self.multimodal_seen = False
            else:
                _, env = experiment.server_command(self.run_config, self.python, self.model, 0)
                record = self.rundir / "registry-standins" / "standins.json"
                record.parent.mkdir(parents=True, exist_ok=True)
                full_env, _ = server_environment(self, env, record, {}, "registry")
                question = registry_question(self.python, full_env, config)
                folder = cache_dir() / "registry" / question.key
                remembered = question.remembered(folder)
                self.multimodal_seen = remembered if remembered is not None else question.ask(
                    self.rundir, folder, START_TIMEOUT_S, "the same import fails the server's start: rehearse "
                    "--check start", lambda text: locate(text, self.tree))
        return self.multimodal_seen

    def whole_files(self) -> frozenset[str]:
        """The transforms that put whole files in place (a located frame in them names the deploy)."""
        return frozenset(t.id for t in self.recipe.transforms if t.kind == "deploy")

    def server_error(self, server: Server) -> str:
        """Why a request failed on the server's side: the first traceback its log shows since it was ready,
        located in the patched tree. The server writes it after the response it sent (starlette answers 500, then
        uvicorn logs the exception), so the log is read again for a few seconds until one is there."""
        log = server.log_path
        deadline = time.monotonic() + SERVER_ERROR_WAIT_S
        while True:
            data = log.read_bytes()[self.ready_at.get(log, 0):] if log.is_file() else b""
            text = data.decode("utf-8", errors="replace")
            if "Traceback (most recent call last)" in text or time.monotonic() > deadline:
                return locate(text, self.tree, self.whole_files())
            time.sleep(0.2)


class StartFailed(Exception):
    pass


@dataclass
class Live:
    """A started server as the checks that need it see it: its argv, and the request runs several checks share
    (sent once, by the first that asks)."""

    spec: ServerSpec
    server: Server
    argv: list[str]
    shared: dict[str, Any] = field(default_factory=dict)

    def once(self, key: str, send: Callable[[], Any]) -> Any:
        if key not in self.shared:
            self.shared[key] = send()
        return self.shared[key]


@contextlib.contextmanager
def start(stage: Stage, spec: ServerSpec, port: int | None = None,
          extra: dict[str, tuple[str, str]] | None = None) -> Iterator[Live]:
    """`spec`'s server ready, stopped (its whole group) at the end whatever happens; its log and its stand-ins
    record in the run folder, what it changes said as substitutions (`extra`: env the checks ask, with why)."""
    port = port or free_port()
    if port_in_use(port):
        raise ToolkitError(f"port {port} is already taken on 127.0.0.1: the rehearsal's server cannot listen there",
                           hint="stop what listens there, or leave --port out (a free port is chosen)")
    tp = spec.tp or stage.tp
    multimodal = stage.multimodal()
    text_only = spec.text_only and multimodal
    images = images_per_prompt(experiment.flag_value(argv_of(stage.run_config), "--limit-mm-per-prompt"))
    several = multimodal and not text_only and images > 1
    budget = SEVERAL_IMAGES_BATCH_TOKENS if several else MULTIMODAL_BATCH_TOKENS if multimodal and not text_only \
        else BATCH_TOKENS
    argv, env, subs = server_command(stage.run_config, stage.python, stage.model, port, tp, stage.image,
                                     stage.recipe.vendor.reference_version, auto_chunks(stage.tree), budget)
    if text_only:
        argv = experiment.set_flag(argv, "--limit-mm-per-prompt", "image=0")
    elif several and images != SEVERAL_IMAGES:
        argv = experiment.set_flag(argv, "--limit-mm-per-prompt", f"image={SEVERAL_IMAGES}")
        subs.append(Substitution("--limit-mm-per-prompt", f"image={images}", f"image={SEVERAL_IMAGES}",
                                 f"the start profiles that many max-size images in one step; {SEVERAL_IMAGES} fit the "
                                 f"tiny model's {SEVERAL_IMAGES_BATCH_TOKENS}-token step and are what several-images "
                                 "sends"))
    if spec.prefix_caching is False:
        argv = [a for a in argv if a != "--enable-prefix-caching"]
    elif spec.prefix_caching and "--enable-prefix-caching" not in argv:
        argv.append("--enable-prefix-caching")
    if spec.dtype is not None:
        argv = experiment.set_flag(argv, "--dtype", spec.dtype)
    argv += [f for f in spec.flags if f not in argv]
    if not any(s.flag == "device memory" for s in stage.rehearsal.substitutions):  # the first server's, once
        subs.append(Substitution("device memory", f"{stage.recipe.hardware.memory_gb:g} GB",
                                 f"{stage.memory_gb:g} GB", "the vendor sizes the KV cache from it, and on this CPU "
                                 "that cache is this machine's memory"))
        stage.rehearsal.substitutions[:0] = subs
    record = stage.rundir / f"{spec.name}-standins" / "standins.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    full_env, env_subs = server_environment(stage, env, record, extra or {}, spec.name)
    stage.rehearsal.substitute(*env_subs, Substitution(
        "working directory", stage.recipe.serve.workdir or "(the image's)", "the run folder",
        "a neutral folder with no vllm/ in it (DESIGN 4), where the server's files are kept"), *spec.substitutions,
        *((TEXT_ONLY,) if text_only else ()))
    log = stage.rundir / f"{spec.name}.log"
    served_name = experiment.flag_value(argv, "--served-model-name") or str(stage.model)
    server = Server(argv, full_env, cwd=stage.rundir, log_path=log, url=f"http://127.0.0.1:{port}",
                    model=served_name)
    stage.rehearsal.logs.append(str(log))
    stage.say(f"rehearse: starting the {spec.name} server (TP {tp}, log {log})")
    server.start()
    try:
        try:
            ready = server.wait_ready(START_TIMEOUT_S)
        except ToolkitError:
            server.stop()
            text = log.read_text(encoding="utf-8", errors="replace") if log.is_file() else ""
            raise StartFailed(locate(text, stage.tree, whole=stage.whole_files())) from None
        stage.ready_at[log] = log.stat().st_size if log.is_file() else 0
        stage.say(f"rehearse: the {spec.name} server is ready after {ready:.1f} s")
        if stage.rehearsal.ready_s is None:
            stage.rehearsal.ready_s = ready
        yield Live(spec, server, argv)
    finally:
        stopped = server.stop()
        stage.say(f"rehearse: the {spec.name} server stopped after {stopped:.1f} s")
    read_record(stage.rehearsal, record, tp)


# what every server's environment gets beyond the run config's, and why (each one printed as a substitution)
ADDED_ENV = {
    "TOKENIZERS_PARALLELISM": ("false", "the tokenizer's threads would share this machine's two cores with the ranks"),
    **{k: (v, "no hub, no usage report: nothing leaves this machine") for k, v in experiment.OFFLINE_ENV.items()},
}


def server_environment(stage: Stage, env: dict[str, str], record: Path, extra: dict[str, tuple[str, str]],
                       name: str) -> tuple[dict[str, str], list[Substitution]]:
    """A server's whole environment: the run config's `env`, with every variable the rehearsal sets, replaces or
    passes through from this machine listed as a Substitution (what the run config says, what runs, why). A run
    config's PYTHONPATH is kept after the patched tree's (each entry the image holds read from the image folder),
    never replaced."""
    subs: list[Substitution] = []

    def put(key: str, value: str, why: str, scope: str = "") -> None:
        out[key] = value
        if env.get(key) != value:
            subs.append(Substitution(f"env {key}{scope}", env.get(key), value, why))

    out = dict(env)
    put("PATH", os.environ.get("PATH", "/usr/bin:/bin"), "this machine's, passed through (the image's is not here)")
    put("HOME", str(Path.home()), "this machine's, passed through")
    # this machine's thread settings stay the caller's (two servers' or a server's and a test's OpenMP threads
    # spinning on the same cores is what made a CPU rehearsal slow)
    for key in THREAD_ENV:
        if key in os.environ:
            put(key, os.environ[key], "this machine's thread setting, passed through")
    for key, (value, why) in ADDED_ENV.items():
        put(key, value, why)
    devices = dict(emulated_devices(stage.recipe), memory_gb=stage.memory_gb)
    runtime = standins.environment(cache_dir() / "runtime", stage.recipe.base_image.gpu_library_names,
                                   stage.tree.paths, stage.recipe.base_image.absent_modules, devices, cpu_device=True,
                                   kernels=stage.recipe.kernel_modules())
    given = env.get("PYTHONPATH")
    if given:
        kept = [str(stage.image / item.lstrip("/")) if stage.image is not None and item.startswith("/")
                and (stage.image / item.lstrip("/")).exists() else item for item in given.split(os.pathsep) if item]
        runtime["PYTHONPATH"] = os.pathsep.join([runtime["PYTHONPATH"], *kept])
    put("PYTHONPATH", runtime.pop("PYTHONPATH"), "the stand-ins' folder, then the patched tree"
        + (", then the run config's own entries (those the image holds read from the image folder)" if given else ""))
    for key, value in runtime.items():
        put(key, value, "the CPU runtime's stand-ins of the image's GPU libraries and devices (the device shims)")
    put(standins.RECORD_ENV, str(record), "where the stand-ins record what they loaded and computed", f" ({name})")
    for key, (value, why) in extra.items():
        put(key, value, why, f" ({name})")
    return out, subs


def read_record(rehearsal: Rehearsal, record: Path, tp: int) -> None:
    """What a stopped server's stand-ins recorded: the references it computed, its shims, and (from the first
    server) the weights check on every rank's load and, at TP > 1, the TP all-reduce counted through ixformer."""
    if not record.is_file():
        # the weights check reads it: a server that wrote none (its stand-ins never loaded) fails it, not skips it
        if not rehearsal.has("weights"):
            rehearsal.checks.append(Check("weights", False, f"no stand-ins record at {record}: the server's "
                                          "Pythons did not load the runtime's stand-ins, so no load was seen"))
        return
    data = standins.read_record(record)
    for name, count in data.get("computed", {}).items():
        rehearsal.references[name] = rehearsal.references.get(name, 0) + int(count)
    for process in [data, *data.get("processes", [])]:
        rehearsal.shims.extend(s for s in process.get("shims", []) if s not in rehearsal.shims)
    loads = [p["load"] for p in [data, *data.get("processes", [])] if p.get("load", {}).get("parameters")]
    if not rehearsal.has("weights"):
        rehearsal.checks.append(weights_check(loads, rehearsal.tp))
        if tp > 1 and not data.get("computed", {}).get(TP_ALL_REDUCE):
            # the image's _all_reduce_in_place reduces through ixformer; a tree that reduced otherwise (upstream's
            # CPU branch, a rewritten all_reduce) or not at all ran a path the device never runs
            rehearsal.checks = [Check("start", False, f"{c.detail}; but at TP {tp} no TP all-reduce went through "
                                      f"{TP_ALL_REDUCE}: the tree's all-reduce took a branch the image never takes")
                                if c.name == "start" else c for c in rehearsal.checks]


TP_ALL_REDUCE = "ixformer.distributed.all_reduce"


def weights_check(loads: list[dict[str, Any]], tp: int) -> Check:
    if not loads:
        return Check("weights", False, "no rank recorded a load of the checkpoint (the load check did not run)")
    problems = [f"{len(load['unwritten'])} parameter(s) never written: {', '.join(load['unwritten'][:3])}"
                for load in loads if load.get("unwritten")]
    problems += [f"{len(load['unused'])} checkpoint tensor(s) written nowhere: {', '.join(load['unused'][:3])}"
                 for load in loads if load.get("unused")]
    if len(loads) != tp:
        problems.append(f"{len(loads)} of {tp} ranks recorded their load")
    parameters = sum(load["parameters"] for load in loads)
    skipped = len(loads[0].get("skipped", []))
    return Check("weights", not problems, "; ".join(problems) or (
        f"every parameter on {len(loads)} rank(s) ({parameters} in all) was written by the loader; "
        f"{skipped} checkpoint tensor(s) skipped as the loader documents (MTP; vision too before 2f7d5f5)"))


