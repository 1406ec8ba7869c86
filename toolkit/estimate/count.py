"""What the served path runs at the target's shapes, per rank and step: the variant's own engine, on the patched tree
with the rehearsal's stand-ins and shims, serving the model at its real widths with one full-attention interval of
layers (vLLM's dummy weights: random, so the experts a token routes to are decided as data decides them), stepped
through prefills and decodes of known shapes while the census (toolkit.runtime.census) counts every operation.

The layers' operations (those under the recipe's `estimate.layer_region`, the probe around each decoder layer) are
scaled from the interval to the model's layer count; the rest (embedding, final norm, LM head, sampling) are not.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.bench import experiment
from toolkit.errors import ToolkitError
from toolkit.estimate.device import Op
from toolkit.runtime import census, census_steps

Say = Callable[[str], None]
CENSUS_TIMEOUT_S = 1800.0
WATCH_S = 0.5  # how often a running census is looked at for a failed rank
BLOCK_TOKENS = 16  # vLLM 0.6.3's default block size


def within(name: str, region: str) -> bool:
    """Whether region `name` is `region` or runs inside it (the probes' names nest by dots)."""
    return name == region or name.startswith(region + ".")


@dataclass(frozen=True)
class Plan:
    """The step shapes the census runs: each prefill length alone, twice, then each batch prefilled and decoded for
    a few steps, then at each context a prefill chunk of `chunk` tokens at that depth and one sequence's decodes
    there. A path's first call may do one-off work (the native MoE's `auto` times its candidates, a cache is
    filled), on any rank: each shape is counted more than once, and priced by each rank's cheapest count of it."""

    prefills: tuple[int, ...] = (16, 16, 256, 256, 2048, 2048)  # each batch's prompt is one more single prefill
    batches: tuple[int, ...] = (1, 2)
    decode_prompt: int = 64
    decode_steps: int = 3
    contexts: tuple[int, ...] = ()
    chunk: int = 256

    def __post_init__(self) -> None:
        whole = self.chunk >= 1 and self.chunk % BLOCK_TOKENS == 0
        if not whole or any(c < self.chunk or c % BLOCK_TOKENS for c in self.contexts):
            raise ValueError(f"a chunk is whole blocks of {BLOCK_TOKENS} tokens, a context a chunk or more of whole "
                             f"blocks: {self}")

    @property
    def max_model_len(self) -> int:
        longest = max([*self.prefills, self.decode_prompt + self.decode_steps + 1,
                       *(c + self.chunk + self.decode_steps + 1 for c in self.contexts)])
        return -(-longest // 1024) * 1024 + 1024

    @property
    def batched_tokens(self) -> int:
        """The step budget: the longest cold prefill in one step, and a batch's prompts; a context's prompt is
        chunked (chunked prefill is on: `census_argv`), so it does not need a budget of its length, which the
        engine's profile run would run at start."""
        short = max([*self.prefills, self.decode_prompt + self.decode_steps + 1, self.chunk])
        return max(-(-short // 1024) * 1024 + 1024, max(self.batches) * self.decode_prompt)

    @property
    def blocks(self) -> int:
        """KV blocks: two budgets' worth, and the longest context's sequence beside them."""
        deep = -(-self.max_model_len // BLOCK_TOKENS) if self.contexts else 0
        return 2 * self.batched_tokens // BLOCK_TOKENS + deep


@dataclass
class CountedStep:
    """One engine step of the census: its shape and each rank's operations, scaled to the model's layers."""

    decodes: tuple[int, ...]
    prefills: tuple[int, ...]
    ranks: dict[int, list[Op]] = field(default_factory=dict)
    depth: int = 0  # a counted context's step (its chunk after `depth` tokens, or its decodes there); 0: a short one

    @property
    def tokens(self) -> int:
        return len(self.decodes) + sum(self.prefills)


@dataclass
class Counted:
    """A variant's census: its steps, where its logs are, what the census changed of the served argv."""

    steps: list[CountedStep]
    folder: Path
    changed: list[str]
    # per bucket, each probe region's entries a step on rank 0, the layers' scaled (what a synchronising profiler
    # pays at each region's boundaries)
    entries: dict[str, dict[str, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what the served path said it chose (profiling notes)


def contexts_for(longest: int, chunk: int = Plan.chunk, decode_steps: int = Plan.decode_steps) -> tuple[int, ...]:
    """The contexts a census counts for a workload whose longest sequence is `longest` tokens: each power of two from
    4,096 it passes, and just below each (a path the served code switches at a power of two, as the adapter's decode
    above 32,768 tokens, is counted on both sides of it: the chunk and decodes after it end at or under the power),
    and its longest; a step at another context is interpolated. Each is a whole number of blocks, as the chunk is:
    a prompt that ends inside a block has the exact checkpoints split its last chunk at the block's start, which a
    cold prefill's count does not have either."""
    reach = chunk + decode_steps + 1  # a point's chunk and decodes lie above its context
    below = chunk + -(-(decode_steps + 1) // BLOCK_TOKENS) * BLOCK_TOKENS
    last = (longest - reach) // BLOCK_TOKENS * BLOCK_TOKENS
    points = [last] if last >= chunk else []  # a context's first chunk is computed, the rest skipped
    power = 4096
    while power + reach < longest:
        points += [power - below, power]
        power *= 2
    return tuple(sorted(set(points)))


def census_argv(run_config: str, python: Path, model: Path, tp: int, plan: Plan) -> tuple[list[str], list[str]]:
    """The variant's server argv as the engine's parser takes it, with what the census needs said: the wide model
    with dummy weights and no tokenizer, the served TP, lengths and blocks for the plan's steps."""
    argv, _ = experiment.server_command(run_config, python, model, 0)
    changes = [("--tensor-parallel-size", str(tp)), ("--max-model-len", str(plan.max_model_len)),
               ("--max-num-batched-tokens", str(plan.batched_tokens)),
               ("--max-num-seqs", str(max(plan.batches))), ("--load-format", "dummy"),
               ("--num-gpu-blocks-override", str(plan.blocks)), ("--swap-space", "0")]
    said = []
    for flag, value in changes:
        before = experiment.flag_value(argv, flag)
        argv = experiment.set_flag(argv, flag, value)
        if before != value:
            said.append(f"{flag} {before or '(not given)'} -> {value}")
    if plan.contexts and "--enable-chunked-prefill" not in argv:
        # a prompt's chunk after its context is chunked prefill's step; 0.6.3 turns it on by itself only above 32K
        argv.append("--enable-chunked-prefill")
        said.append("--enable-chunked-prefill (a chunk at a context is chunked prefill's step)")
    if "--skip-tokenizer-init" not in argv:
        argv.append("--skip-tokenizer-init")
        said.append("--skip-tokenizer-init (the wide model has no tokenizer)")
    module = argv.index("-m")
    return argv[module + 2:], said


def _steps(folder: Path, labels: list[dict[str, Any]], step_region: str) -> dict[int, list[dict[str, Any]]]:
    """Each rank's last len(labels) steps, of the outermost region `step_region` (the ones before are the engine's
    profile run; another outermost region is not a step)."""
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for line in census.read(folder):
        if line.get("region") == step_region:
            by_pid.setdefault(int(line["pid"]), []).append(line)
    ranks: dict[int, list[dict[str, Any]]] = {}
    for lines in by_pid.values():
        if len(lines) < len(labels):
            continue  # a process that ran no engine step of ours (a registry check, a tokenizer child)
        rank = lines[-1]["rank"]
        ranks[int(rank) if rank is not None else 0] = lines[-len(labels):]
    return ranks


def operations(rows: list[list[Any]], layer_region: str, scale: float) -> list[Op]:
    """A step's census rows as priced operations, the layers' scaled to the model's count."""
    ops = []
    for region, name, dtype, kind, shapes, calls, flops, nbytes in rows:
        factor = scale if within(region, layer_region) else 1.0
        ops.append(Op(name, region, flops * factor, nbytes * factor, dtype, collective=kind == "collective",
                      calls=calls * factor, shapes=shapes))
    return ops


def count(run_config: str, env: dict[str, str], python: Path, model: Path, tp: int, folder: Path, layers: int,
          census_layers: int, layer_region: str, plan: Plan, say: Say) -> Counted:
    """The census of one variant: its engine run by `python` (the CPU runtime) in the server's environment `env`
    (the run config's, the stand-ins', the patched tree on PYTHONPATH), its records in `folder`."""
    folder = folder.resolve()  # the census runs in it: every path it is given must not depend on where we are
    model = model.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    args, changed = census_argv(run_config, python, model, tp, plan)
    config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    records = folder / "census"
    labels_file = folder / "steps.json"
    plan_file = folder / "plan.json"
    plan_file.write_text(json.dumps({"args": args, "prefills": list(plan.prefills), "batches": list(plan.batches),
                                     "decode_prompt": plan.decode_prompt, "decode_steps": plan.decode_steps,
                                     "contexts": list(plan.contexts), "chunk": plan.chunk,
                                     "vocab": int(config.get("text_config", config)["vocab_size"]),
                                     "labels": str(labels_file)}), encoding="utf-8")
    # on a CPU every operation has ended when it returns: the census run's own region times are attributed as a
    # synchronised profile's are (its records can be fitted on, as the target's)
    full_env = {**env, "TOOLKIT_PROFILE": "1", "TOOLKIT_PROFILE_SYNC": "1",
                "TOOLKIT_PROFILE_DIR": str(folder / "profile"), census.ENV: str(records.resolve())}
    log = folder / "census.log"
    say(f"estimate: counting the served path at TP {tp} (prefills of {', '.join(map(str, sorted(set(plan.prefills))))} "
        f"tokens, batches "
        f"{', '.join(map(str, plan.batches))}; log {log})")
    started = time.monotonic()
    with log.open("w", encoding="utf-8") as out, _terminated_as_exit():
        process = subprocess.Popen([str(python), census_steps.__file__, str(plan_file)], cwd=folder, env=full_env,
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code, failed = _watch(process, records, labels_file)
        finally:
            # the engine's workers are in its session, and spin when their driver is gone: none outlives the census,
            # however it ends (an error, Ctrl-C, a SIGTERM)
            _kill_group(process.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
    if code != 0:
        tail = log.read_text(encoding="utf-8", errors="replace")[-3000:]
        if failed:
            why = f"stopped: {_failed_ranks(failed, records)}"
        else:
            why = f"ran past {CENSUS_TIMEOUT_S:.0f} s" if code is None else f"exited {code}"
        raise ToolkitError(f"the census of the served path {why} (log {log}):\n{tail}",
                           hint="the same tree and env start in `toolkit rehearse`: rehearse the variant first")
    counted = read(folder, tp, layers, census_layers, layer_region)
    counted.changed = changed
    say(f"estimate: counted {len(counted.steps)} steps on {tp} rank(s) in {time.monotonic() - started:.0f} s")
    return counted


def count_cached(key: str, run_config: str, env: dict[str, str], python: Path, model: Path, tp: int, folder: Path,
                 layers: int, census_layers: int, layer_region: str, plan: Plan, say: Say) -> Counted:
    """`count` into `folder`, remembered under `key` (everything the census's records depend on: the caller's to
    say) in the toolkit's cache: a census of the same code path on the same tree is read back from there instead
    of run again. A census that fails leaves nothing cached (its logs stay in `folder`)."""
    import shutil

    from toolkit.inputs import COMPLETE, cache_dir, cached_tree

    target = cache_dir() / "census" / key
    if (target / COMPLETE).is_file():
        counted = read(target, tp, layers, census_layers, layer_region)
        counted.changed = census_argv(run_config, python, model, tp, plan)[1]
        say(f"estimate: the census of this code path is cached ({target})")
        return counted
    counted = count(run_config, env, python, model, tp, folder, layers, census_layers, layer_region, plan, say)

    def keep(tree: Path, scratch: Path) -> None:
        shutil.copytree(folder, tree, symlinks=True)

    cached_tree(target, keep)
    return counted


def _watch(process: subprocess.Popen[bytes], records: Path, labels: Path) -> tuple[int | None, list[dict[str, Any]]]:
    """Wait for the census: its exit code, or None with the failures a rank wrote (the other ranks would wait on it
    in a collective for gloo's 30 minutes), or None and none past CENSUS_TIMEOUT_S. Once every step ran (the steps'
    labels are written), a rank that dies is the engine's shutdown (multiprocessing ends its workers at exit, and
    vLLM's monitor logs each as dead): the census waits for its exit code."""
    deadline = time.monotonic() + CENSUS_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return process.wait(WATCH_S), []
        failed = census.failures(records)  # read before the labels: a shutdown's failure follows them
        if failed and not labels.exists():
            return None, failed
    return None, []


def _failed_ranks(failed: list[dict[str, Any]], records: Path) -> str:
    """What each failing process logged, and which rank each pid of the census was (from the steps it counted)."""
    said = "; ".join(f"rank {f['rank'] if f['rank'] is not None else '?'} (pid {f['pid']}) logged: "
                     f"{str(f['message']).strip().splitlines()[0][:500]}" for f in failed)
    ranks = {int(line["pid"]): line["rank"] for line in census.read(records)} if records.is_dir() else {}
    known = ", ".join(f"pid {pid} rank {rank}" for pid, rank in sorted(ranks.items()) if rank is not None)
    return said + (f" (the census's ranks: {known})" if known else "")


def read(folder: Path, tp: int, layers: int, census_layers: int, layer_region: str) -> Counted:
    """A census run's steps as its folder holds them (steps.json, census/, profile/)."""
    labels = json.loads((folder / "steps.json").read_text(encoding="utf-8"))
    records = folder / "census"
    per_rank = _steps(records, labels, layer_region.split(".")[0])
    if len(per_rank) != tp:
        raise ToolkitError(f"the census counted {len(per_rank)} rank(s) at TP {tp} (records in {records})",
                           hint="each rank counts inside the probes' `step` region: does the recipe include the "
                           "probes layer (TOOLKIT_PROFILE=1)?")
    scale = layers / census_layers
    steps = [CountedStep(tuple(label["decodes"]), tuple(label["prefills"]), depth=int(label.get("depth", 0)))
             for label in labels]
    for rank, lines in per_rank.items():
        for step, line in zip(steps, lines, strict=True):
            step.ranks[rank] = operations(line["ops"], layer_region, scale)
    if not any(op.region.startswith(layer_region) for op in steps[0].ranks[min(per_rank)]):
        raise ToolkitError(f"no operation ran in the layer region {layer_region!r}: its layers would not be scaled "
                           f"to the model's {layers}", hint="estimate.layer_region names the probe region around "
                           "each decoder layer (layers/qwen36-adapter.yaml's probe-decoder-layer)")
    entries, notes = region_entries(folder / "profile", layer_region, scale)
    return Counted(steps, folder, [], entries, notes)


def region_entries(profile: Path, layer_region: str, scale: float) -> tuple[dict[str, dict[str, float]], list[str]]:
    """Per bucket, how often each region is entered a step on rank 0 (its calls over the step region's, the root of
    `layer_region`, from the census run's own TOOLKIT_PROFILE records), the layers' scaled; and the processes'
    notes."""
    from toolkit.bench.profile import load

    processes = load([profile])
    first = min(processes, key=lambda p: (p.rank is None, p.rank or 0))
    counts: dict[str, dict[str, float]] = {}
    for (bucket, region), (calls, _, _) in first.regions.items():
        counts.setdefault(bucket, {})[region] = float(calls)
    out: dict[str, dict[str, float]] = {}
    for bucket, per_region in counts.items():
        steps = per_region.get(layer_region.split(".")[0]) or 1.0
        out[bucket] = {region: n / steps * (scale if within(region, layer_region) else 1.0)
                       for region, n in per_region.items()}
    return out, sorted({note for p in processes for note in p.notes})


@contextlib.contextmanager
def _terminated_as_exit() -> Iterator[None]:
    """A SIGTERM to this process unwinds it (SystemExit) while the census runs, so its group is stopped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)

