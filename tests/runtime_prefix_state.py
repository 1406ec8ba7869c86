"""Prefix caching and the hybrid model's linear-attention state, through vLLM 0.6.3's own code on the CPU runtime.

Run with a patched vendor root (and the patched transformers) first on sys.path (see test_prefix_state.py). An
engine loop as LLMEngine's: vLLM's Scheduler with its prefix-caching block manager, ModelRunner.prepare_model_input
(the builder's prefix-hit trimming, the attention metadata, the sampling metadata) and ModelRunner.execute_model
(the sampler), around the pinned adapter's hybrid model (full attention over vLLM's paged cache from its
CacheEngine, GatedDeltaNet state in vLLM's MambaCacheManager, the adapter's own prefix LRU). Each case runs twice,
prefix caching on and off, and the later request's greedy tokens and logits are compared. Prints one JSON object.

argv: what to run (default: everything, one JSON object keyed by name): case names, `workload` for the
conversation workload's hit rates, `stale` for a request restored from another request's state after block reuse,
in the four configurations, `short_chunk` for a prefill chunk shorter than the conv kernel's history.
"""

import atexit
import json
import os
import shutil
import sys
import tempfile

import runtime_shims
import torch

BLOCK = 16
CONFIG = {"hidden_size": 32, "num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
          "head_dim": 64, "vocab_size": 64, **runtime_shims.SMALL_HYBRID, "torch_dtype": "float32",
          "full_attention_interval": 4,
          "max_position_embeddings": 4096}


def checkpoint():
    folder = tempfile.mkdtemp(prefix="prefix-state-config-")
    atexit.register(shutil.rmtree, folder, True)  # this script made it; nothing of it outlives the run
    with open(os.path.join(folder, "config.json"), "w") as handle:
        json.dump({"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe",
                   "torch_dtype": "float32", "text_config": CONFIG,
                   "vision_config": runtime_shims.vision_config(CONFIG["hidden_size"])}, handle)
    return folder


class Engine:
    """What LLMEngine.step does around the scheduler and the model runner, without tokenizer or detokenizer."""

    def __init__(self, folder, prefix_caching, blocks=64, budget=512, max_seqs=4):
        from vllm.config import CacheConfig, DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, SchedulerConfig
        from vllm.core.scheduler import Scheduler
        from vllm.model_executor.models import qwen3_5
        from vllm.worker.cache_engine import CacheEngine
        from vllm.worker.model_runner import ModelRunner

        model_config = ModelConfig(folder, folder, "auto", False, "float32", 0, max_model_len=1024,
                                   enforce_eager=True, skip_tokenizer_init=True)  # as the flagship serves
        parallel = ParallelConfig(1, 1, False)
        cache = CacheConfig(BLOCK, 0.9, 0, "auto", enable_prefix_caching=prefix_caching)
        cache.num_gpu_blocks, cache.num_cpu_blocks = blocks, 0
        scheduler_config = SchedulerConfig(budget, max_seqs, 1024, use_v2_block_manager=True,
                                           enable_chunked_prefill=True)
        self.scheduler = Scheduler(scheduler_config, cache, None)
        self.runner = ModelRunner(model_config, parallel, scheduler_config, DeviceConfig("cpu"), cache,
                                  LoadConfig(), None, is_driver_worker=True)
        self.runner.model = runtime_shims.seeded(qwen3_5.Qwen3_5MoeForCausalLM(
            model_config.hf_config, cache, scheduler_config=scheduler_config).eval())
        self.kv_caches = CacheEngine(cache, model_config, parallel, DeviceConfig("cpu")).gpu_cache
        try:
            from native_fastpaths import prefix_state
            prefix_state.STORE.states.clear()  # a fresh server holds no checkpoint
        except ImportError:
            pass
        self.groups, self.logits, self.tables, self.next_seq = {}, {}, {}, 0
        self._rows = []
        compute_logits = self.runner.model.compute_logits

        def recording(hidden_states, sampling_metadata=None):
            logits = compute_logits(hidden_states, sampling_metadata)
            for row, request_id in enumerate(self._rows):
                self.logits.setdefault(request_id, []).append(logits[row].clone())
            return logits

        self.runner.model.compute_logits = recording

    def add(self, request_id, tokens, max_tokens):
        from vllm.sampling_params import SamplingParams
        from vllm.sequence import Sequence, SequenceGroup

        seq = Sequence(self.next_seq, {"prompt_token_ids": list(tokens)}, BLOCK)
        self.next_seq += 1
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        group = SequenceGroup(request_id, [seq], arrival_time=0.0, sampling_params=params)
        self.scheduler.add_seq_group(group)
        self.groups[request_id] = group

    def step(self):
        from vllm.sequence import SequenceStatus

        metas, outputs, _ = self.scheduler.schedule()
        if not outputs.scheduled_seq_groups:
            return False
        for scheduled in outputs.scheduled_seq_groups:  # the physical blocks each request holds now
            group = scheduled.seq_group
            self.tables[group.request_id] = list(self.scheduler.block_manager.get_block_table(group.seqs[0]))
        finished = self.scheduler.get_and_reset_finished_requests_ids()
        model_input = self.runner.prepare_model_input(metas, 0, finished)
        self._rows = [m.request_id for m in metas if m.do_sample for _ in m.seq_data]
        sampled = self.runner.execute_model(model_input, self.kv_caches)[0]
        for scheduled, meta, group_output in zip(outputs.scheduled_seq_groups, metas, sampled.outputs, strict=True):
            group = scheduled.seq_group
            group.update_num_computed_tokens(scheduled.token_chunk_size)
            if not meta.do_sample:
                continue
            for sample in group_output.samples:
                seq = group.seqs[0]
                seq.append_token_id(sample.output_token, sample.logprobs)
                if seq.get_output_len() >= group.sampling_params.max_tokens:
                    seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        self.scheduler.free_finished_seq_groups()
        return True

    def run(self, until=None):
        while (until is None or not until()) and self.step():
            pass

    def decoding(self, request_id):
        group = self.groups[request_id]
        return not group.is_prefill() and group.seqs[0].get_output_len() > 0

    def tokens(self, request_id):
        return self.groups[request_id].seqs[0].get_output_token_ids()

    def cached_tokens(self, request_id):
        return getattr(self.groups[request_id].metrics, "num_cached_tokens", None)


def prompt(seed, length):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG["vocab_size"], (length,), generator=g).tolist()


A = prompt(1, 100)


def control(engine):
    engine.add("A", A, 4)
    engine.run()
    engine.add("X", prompt(2, 110), 6)
    engine.run()


def exact(engine):
    """(c) the hit is exactly A's saved key (6 full blocks), but A's saved state holds its tokens 96..99 too."""
    engine.add("A", A, 4)
    engine.run()
    engine.add("X", A[:96] + prompt(3, 14), 6)
    engine.run()


def shared(engine):
    """(a) a shared system prefix: 3 full blocks in common, a length no state was saved at."""
    engine.add("A", A, 4)
    engine.run()
    engine.add("X", A[:48] + prompt(4, 62), 6)
    engine.run()


def mixed(engine):
    """(b) the hit of (c) while another request decodes: the step holds two sequences."""
    engine.add("A", A, 4)
    engine.run()
    engine.add("E", prompt(5, 40), 30)
    engine.run(until=lambda: engine.decoding("E"))
    engine.add("X", A[:96] + prompt(3, 14), 6)
    engine.run()


def reused(engine):
    """(d) physical block 0 held K's content when K's state was saved under (0,); after an eviction it holds G's,
    and X hits G's block: the block-id key finds K's state."""
    engine.add("K", prompt(6, 16), 1)
    engine.run()
    engine.add("A2", prompt(7, 20), 1)
    engine.run()
    engine.add("H", prompt(8, 20), 10)
    engine.run(until=lambda: engine.decoding("H"))
    engine.add("G", prompt(9, 20), 1)  # beside H's decode: the adapter saves nothing for it
    engine.run()
    engine.add("X", prompt(9, 20)[:16] + prompt(10, 4), 6)
    engine.run()


def chunked(engine):
    """Chunked prefill of 32-token chunks across (c)'s hit, with a checkpoint every block: the first chunk starts at
    the hit's last checkpoint (96) and carries its state to the next two."""
    engine.add("A", A, 4)
    engine.run()
    engine.add("X", A[:96] + prompt(3, 50), 6)
    engine.run()


def evicted(engine):
    """A's blocks are evicted (F fills the pool) while A's checkpoint at 96 stays; C refills A's first 6 block
    hashes, runs one 32-token chunk and is aborted: vLLM's v2 block manager keeps C's blocks as computed, so X's hit
    covers 6 blocks of which C wrote 2. Restoring A's checkpoint there would skip KV nobody wrote."""
    engine.add("A", A, 1)
    engine.run()
    engine.add("F", prompt(15, 250), 1)
    engine.run()
    engine.add("C", A[:96] + prompt(16, 50), 1)
    engine.step()
    engine.scheduler.abort_seq_group("C")
    engine.add("X", A[:96] + prompt(3, 14), 6)
    engine.run()


CASES = {"control": (control, {}), "exact": (exact, {}), "shared": (shared, {}), "mixed": (mixed, {}),
         "reused": (reused, {"blocks": 4}), "chunked": (chunked, {"budget": 32, "interval": 16}),
         "switched-off": (exact, {"switch": "0"}), "evicted": (evicted, {"blocks": 17, "budget": 32})}


def conversations(engine, sessions=4, turns=3, concurrency=2):
    """The official shape, in tokens: cumulative multi-turn sessions whose requests all start with the same
    system prompt and tool schemas; each later turn re-renders the earlier answer without its first 3 tokens (the
    reasoning the chat template drops) and adds a user message. Two sessions run at a time."""
    system_and_tools = prompt(20, 24) + prompt(21, 80)
    history = {s: system_and_tools + prompt(30 + s, 20) for s in range(sessions)}
    records = []
    for first in range(0, sessions, concurrency):
        group = range(first, min(first + concurrency, sessions))
        for turn in range(turns):
            for s in group:
                engine.add(f"s{s}t{turn}", history[s], 8)
            engine.run()
            for s in group:
                rid = f"s{s}t{turn}"
                answer = list(engine.tokens(rid))
                records.append({"request": rid, "prompt": len(history[s]), "cached": engine.cached_tokens(rid) or 0,
                                "tokens": answer})
                history[s] = history[s] + answer[3:] + prompt(100 * s + turn, 24)
    return records


def workload(folder):
    """Hit rate, tokens recomputed and wrong answers of the conversation workload, cache on against cache off, with
    the switches at their defaults (as the flagship serves)."""
    for name in ("PREFIX_STATE", "PREFIX_STATE_INTERVAL"):
        os.environ.pop(name, None)  # a case run before it in this process set them
    runs = {}
    for caching in (True, False):
        engine = Engine(folder, caching, blocks=256)
        runs[caching] = (conversations(engine), store_bytes())
    on, off = runs[True][0], runs[False][0]
    prompt_tokens = sum(r["prompt"] for r in on)
    cached = sum(r["cached"] for r in on)
    return {"requests": len(on), "prompt_tokens": prompt_tokens, "cached_tokens": cached,
            "cache_hit_rate": cached / prompt_tokens, "recomputed_tokens": prompt_tokens - cached,
            "wrong_answers": sum(a["tokens"] != b["tokens"] for a, b in zip(on, off, strict=True)),
            "checkpoint_bytes": runs[True][1]}


def case(folder, name):
    scenario, options = CASES[name]
    options = dict(options)
    os.environ["PREFIX_STATE_INTERVAL"] = str(options.pop("interval", 4096))
    os.environ["PREFIX_STATE"] = options.pop("switch", "1")
    runs, held = {}, {}
    for caching in (True, False):
        engine = Engine(folder, caching, **options)
        scenario(engine)
        runs[caching], held[caching] = engine, store_bytes()
    on, off = runs[True], runs[False]
    diff = max(float((a - b).abs().max()) for a, b in zip(on.logits["X"], off.logits["X"], strict=True))
    spread = min(float(row.max() - row.min()) for row in off.logits["X"])
    return {"tokens_on": on.tokens("X"), "tokens_off": off.tokens("X"), "max_abs_logit_diff": diff,
            "smallest_logit_spread": spread, "cached_tokens": on.cached_tokens("X"),
            "checkpoint_bytes": held[True]}


Y_PROMPT = prompt(11, 40)
X_PROMPT = Y_PROMPT[:16] + prompt(13, 44)  # X's first block is Y's (so the prefix cache hands X that very block)
STALE_POOL, STALE_BUDGET = 5, 48


def stale_scenario(engine):
    """(2) Y (40 tokens) prefills alone and finishes: the adapter saves Y's state under Y's first two block ids.
    E decodes while Z (32 tokens) prefills beside it and finishes, taking the free blocks (so the next request gets
    Y's) and turning Y's two ids around in the free list again; X (60 tokens) starts while E still decodes, so its
    first chunk (47 tokens) shares a step with E (the adapter saves nothing for X) and gets Y's blocks, in Y's
    order. E finishes with that step: X's second chunk runs alone at context 47 and looks up its first two ids."""
    engine.add("Y", Y_PROMPT, 1)
    engine.run()
    engine.add("E", prompt(12, 8), 3)
    engine.run(until=lambda: engine.decoding("E"))
    engine.add("Z", prompt(14, 32), 1)
    engine.run(until=lambda: engine.groups["Z"].is_finished())
    engine.add("X", X_PROMPT, 6)
    engine.run()


def stale(folder):
    """Case (2) in the four configurations (prefix caching on/off, PREFIX_STATE 1/0), each against a fresh run of
    X alone with the same configuration (a cache-on/off comparison cannot see it: the block reuse happens in both).
    `reused` says the arrangement happened: X's first two blocks are Y's, in Y's order."""
    out = {}
    for switch in ("1", "0"):
        os.environ["PREFIX_STATE"] = switch
        os.environ["PREFIX_STATE_INTERVAL"] = "4096"
        for caching in (True, False):
            engine = Engine(folder, caching, blocks=STALE_POOL, budget=STALE_BUDGET)
            stale_scenario(engine)
            alone = Engine(folder, caching, blocks=STALE_POOL, budget=STALE_BUDGET)
            alone.add("X", X_PROMPT, 6)
            alone.run()
            diff = max(float((a - b).abs().max()) for a, b in zip(engine.logits["X"], alone.logits["X"], strict=True))
            out[f"caching-{'on' if caching else 'off'}-switch-{switch}"] = {
                "reused": engine.tables["X"][:2] == engine.tables["Y"][:2], "tables": engine.tables,
                "tokens": engine.tokens("X"), "tokens_alone": alone.tokens("X"), "max_abs_logit_diff": diff}
    return out


def short_chunk(folder):
    """A prompt one token past a chunk boundary (33 tokens, 32-token chunks: its last chunk is 1 token, shorter than
    the conv kernel's 3-token history), prefix caching off, against the same prompt in one chunk: the same tokens
    and logits."""
    os.environ["PREFIX_STATE"], os.environ["PREFIX_STATE_INTERVAL"] = "1", "4096"
    runs = {}
    for budget in (32, 512):
        engine = Engine(folder, False, budget=budget)
        engine.add("X", prompt(17, 33), 6)
        engine.run()
        runs[budget] = engine
    diff = max(float((a - b).abs().max()) for a, b in zip(runs[32].logits["X"], runs[512].logits["X"], strict=True))
    return {"tokens_chunked": runs[32].tokens("X"), "tokens_whole": runs[512].tokens("X"), "max_abs_logit_diff": diff}


def store_bytes():
    try:
        from native_fastpaths import prefix_state
    except ImportError:
        return None
    return prefix_state.STORE.nbytes()


def main():
    runtime_shims.on_cpu()
    runtime_shims.distributed()
    folder = checkpoint()
    # one process for everything asked (importing vLLM is most of a short run)
    asked = sys.argv[1:] or [*CASES, "workload", "stale", "short_chunk"]
    modes = {"workload": workload, "stale": stale, "short_chunk": short_chunk}
    json.dump({name: modes[name](folder) if name in modes else case(folder, name) for name in asked}, sys.__stdout__)


if __name__ == "__main__":
    sys.stdout = sys.stderr
    main()
