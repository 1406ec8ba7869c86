"""GatedDeltaNet state that survives a prefix-cache hit exactly (not a fast path: deployed with them).

vLLM 0.6.3 does not compute a prefix hit's tokens again: the model runner feeds only the uncached ones, so a
linear-attention layer sees the prefix only through the recurrent state it starts from. That state must be the
state after exactly the cached tokens. This module makes it so, in three places:

- the scheduler (`begin_schedule`, `limit_hit`, `attach`): a prefill chunk starts at the last exact checkpoint
  its hit reaches (the rest of the hit is recomputed), and each prefill chunk gets a plan: which checkpoint it
  restores, at which block boundaries it captures one, which it evicts. Checkpoints are keyed by (blocks, the
  chained content hash of those blocks), the hash vLLM's prefix cache uses, never by physical block ids (they are
  reused after an eviction). The registry of checkpoints is bounded (PREFIX_STATE_CHECKPOINTS) and lives with
  the scheduler; the workers only do what the plans say, so scheduler and workers agree on what exists.
- the model runner (`with_plan`, `begin_step`): the plan per batch row travels in the model input, broadcast to
  every tensor-parallel rank.
- the adapter's GatedDeltaNet layer (`gdn_forward`, dispatched from the top of `GatedDeltaNet.forward`): each
  planned prefill row runs alone, split at its capture offsets, with its state restored first (from a
  checkpoint, or from its own previous chunk), in mixed batches too; decode rows run together, untouched.

PREFIX_STATE=0 turns every prefix hit off instead (always correct, nothing reused). Checkpoints are held in host
memory, one copy of every linear-attention layer's conv and recurrent state per checkpoint per rank. The adapter's
own block-id LRU is taken out of its forward by the flagship (prefix-state-no-block-id-*), so this module is the
only owner of that state, whatever the switches; each plan carries the PREFIX_STATE value the scheduler read, and
a worker that reads another raises.
Imports only the standard library and torch; vLLM is imported inside the functions that need it.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import OrderedDict
from typing import Any

from native_fastpaths import switches

SWITCH = "PREFIX_STATE"
CAPACITY = "PREFIX_STATE_CHECKPOINTS"
INTERVAL = "PREFIX_STATE_INTERVAL"

Key = tuple[int, int]  # (number of blocks, chained content hash of those blocks)

# imported by the scheduler when the server starts: every switch the environment sets is judged there, so a bad
# value (PREFIX_STATE_INTERVAL=4k, MOE_NATIVE=true) stops the start instead of the first request
switches.check_environment()


def enabled() -> bool:
    return switches.on(SWITCH)


# -- scheduler side ---------------------------------------------------------------------------------------------

class Registry:
    """The checkpoints that exist (or will after this step), least recently used first. A key captured in this
    scheduling pass becomes restorable from the next one: the workers capture it during this step.

    Each key remembers the content hashes of its blocks: when vLLM's prefix cache evicts one of them, the key is
    dropped (`evicted`). vLLM 0.6.3's v2 block manager marks a cached block computed at the end of the pass that
    allocated it, before the chunk that writes it runs (and keeps a freed, never-written block as computed), so
    after an eviction a later request may refill the same hash and a hit may cover KV nobody wrote yet; a
    checkpoint over blocks that never left the cache guarantees the KV it skips is the KV it was captured with."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.ready: OrderedDict[Key, None] = OrderedDict()
        self.pending: OrderedDict[Key, None] = OrderedDict()
        self.pinned: set[Key] = set()
        self.chains: dict[Key, tuple[int, ...]] = {}
        self.holders: dict[int, set[Key]] = {}
        self.dropped: list[Key] = []  # dropped for an evicted block; the workers learn it with the next plan
        _REGISTRIES.add(self)

    def next_pass(self) -> None:
        self.ready.update(self.pending)
        self.pending.clear()
        self.pinned.clear()

    def use(self, key: Key) -> None:
        self.ready.move_to_end(key)
        self.pinned.add(key)

    def add(self, key: Key, chain: tuple[int, ...]) -> list[Key] | None:
        """Register a capture; the keys it evicts, or None when every slot is pinned by this pass."""
        if key in self.ready or key in self.pending:
            return []
        evicted: list[Key] = []
        while len(self.ready) + len(self.pending) >= self.capacity:
            victim = next((k for k in self.ready if k not in self.pinned), None)
            if victim is None:
                return None
            del self.ready[victim]
            self._forget(victim)
            evicted.append(victim)
        if key in self.dropped:
            self.dropped.remove(key)  # captured again this step: the workers overwrite the stale copy
        self.pending[key] = None
        self.pinned.add(key)
        self.chains[key] = chain
        for content_hash in chain:
            self.holders.setdefault(content_hash, set()).add(key)
        return evicted

    def drop(self, content_hash: int) -> None:
        for key in self.holders.pop(content_hash, set()):
            self.ready.pop(key, None)
            self.pending.pop(key, None)
            self._forget(key)
            self.dropped.append(key)

    def take_dropped(self) -> list[Key]:
        dropped, self.dropped = self.dropped, []
        return dropped

    def _forget(self, key: Key) -> None:
        for content_hash in self.chains.pop(key, ()):
            keys = self.holders.get(content_hash)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self.holders[content_hash]


_REGISTRIES: weakref.WeakSet[Registry] = weakref.WeakSet()


def evicted(content_hash: int) -> None:
    """In PrefixCachingBlockAllocator._maybe_allocate_evicted_block_id: a cached block's content leaves vLLM's
    prefix cache (its block is given to other content), so no checkpoint over it is restored again."""
    for registry in list(_REGISTRIES):
        registry.drop(content_hash)


def _registry(scheduler: Any) -> Registry:
    registry = getattr(scheduler, "_prefix_state_registry", None)
    if registry is None:
        if enabled() and getattr(getattr(scheduler, "scheduler_config", None), "send_delta_data", False):
            # SPMD workers get a SequenceGroupMetadataDelta after the first chunk, which carries no plan
            raise RuntimeError("prefix_state: the scheduler sends delta metadata (VLLM_USE_RAY_SPMD_WORKER=1), "
                               "which carries no prefix-state plan: serve without SPMD workers, or with "
                               f"{SWITCH}=0")
        registry = Registry(switches.count(CAPACITY))
        scheduler._prefix_state_registry = registry
    return registry


def begin_schedule(scheduler: Any) -> None:
    """At the top of Scheduler.schedule."""
    _registry(scheduler).next_pass()


def _chain(seq_group: Any, seq: Any, blocks: int, block_size: int) -> list[int]:
    """The chained content hash of each of the first `blocks` full blocks, as vLLM's prefix cache computes it;
    kept on the sequence group (a prompt's tokens do not change while it is prefilled)."""
    from vllm.core.block.prefix_caching_block import PrefixCachingBlock

    cached: list[int] = getattr(seq_group, "_prefix_state_chain", [])
    tokens = seq.data.get_token_ids()
    while len(cached) < blocks:
        i = len(cached)
        cached.append(PrefixCachingBlock.hash_block_tokens(
            i == 0, cached[-1] if cached else None, tokens[i * block_size:(i + 1) * block_size]))
    seq_group._prefix_state_chain = cached
    return cached


def limit_hit(scheduler: Any, scheduled: Any, computed_block_nums: list[int]) -> tuple[list[int], int]:
    """After get_common_computed_block_ids: the blocks this prefill chunk may skip and the chunk's size.

    The chunk first jumps to the last checkpoint the hit reaches (the sequence's computed tokens advance to it, the
    chunk keeps its size, less where the prompt ends sooner): vLLM 0.6.3's scheduler budgets a chunk from the
    computed tokens on, and a hit inside a chunk is only skipped up to a checkpoint in that chunk, so without the
    jump every chunk before the one holding a checkpoint would be recomputed. Then the hit is cut back to the
    longest prefix with an exact checkpoint (the rest is recomputed), and the chunk's plan is kept on the sequence
    group for `attach`. Both the ScheduledSequenceGroup and the returned size carry the new chunk size (the engine
    advances the computed tokens by the metadata's)."""
    seq_group, token_chunk_size = scheduled.seq_group, scheduled.token_chunk_size
    seq_group._prefix_state_plan = None
    if not seq_group.is_prefill():
        return computed_block_nums, token_chunk_size
    seq = seq_group.get_seqs()[0]
    block_size = scheduler.cache_config.block_size
    context = seq.data.get_num_computed_tokens()
    hit = len(computed_block_nums)
    if not enabled():
        seq_group._prefix_state_skipped = 0
        return list(computed_block_nums[:context // block_size]), token_chunk_size
    registry = _registry(scheduler)
    length = seq.data.get_len()
    chain = _chain(seq_group, seq, hit, block_size)  # the search's keys; the captures' below

    start, restore = context, None
    # at least one token stays to compute: the runner recomputes the last token of a chunk the hit covers whole
    # and writes its KV, which needs the state right before it (no checkpoint holds that)
    for blocks in range(min(hit, (length - 1) // block_size), context // block_size, -1):
        key = (blocks, chain[blocks - 1])
        if key in registry.ready:
            start, restore = blocks * block_size, key
            registry.use(key)
            break
    if start > context:
        seq.data.update_num_computed_tokens(start - context)
        token_chunk_size = scheduled.token_chunk_size = min(token_chunk_size, length - start)
    end = start + token_chunk_size

    prompt_end = (length // block_size) * block_size
    interval = switches.count(INTERVAL)
    if interval % block_size:
        raise ValueError(f"{INTERVAL}={interval} is not a multiple of the block size {block_size}: its capture "
                         "points would never fall on a block boundary (no checkpoint would be taken there)")
    points = {prompt_end, hit * block_size}
    if interval:
        points.update(range(interval, end + 1, interval))
    chain = _chain(seq_group, seq, end // block_size, block_size)
    captures, evict = [], registry.take_dropped()
    for point in sorted(p for p in points if start < p <= end and p % block_size == 0):
        key = (point // block_size, chain[point // block_size - 1])
        lru = registry.add(key, tuple(chain[:point // block_size]))
        if lru is None:
            break
        evict.extend(lru)
        captures.append((point, key))
    seq_group._prefix_state_plan = {
        "switch": switches.value(SWITCH), "start": start, "restore": restore, "captures": captures, "evict": evict,
        "fresh": start == 0, "carry_in": start == context > 0, "carry_out": end < length,
    }
    seq_group._prefix_state_skipped = getattr(seq_group, "_prefix_state_skipped", 0) + start - context
    return list(computed_block_nums[:start // block_size]), token_chunk_size


def attach(seq_group: Any, seq_group_metadata: Any) -> None:
    """After the step's metadata is built: the plan goes with it, and the request's cached-token count (the
    usage's cached_tokens) is the number of prompt tokens really skipped."""
    plan = getattr(seq_group, "_prefix_state_plan", None)
    if plan is not None and hasattr(seq_group_metadata, "prefix_state"):
        seq_group_metadata.prefix_state = plan
    metrics = getattr(seq_group, "metrics", None)
    skipped = getattr(seq_group, "_prefix_state_skipped", None)
    if skipped is not None and seq_group.is_prefill() and hasattr(metrics, "num_cached_tokens"):
        metrics.num_cached_tokens = skipped


# -- model runner side ------------------------------------------------------------------------------------------

def with_plan(model_input: Any, seq_group_metadata_list: list[Any]) -> Any:
    """In prepare_model_input: the plans by batch row (prefill rows come first, in the metadata's order, as the
    attention metadata and the mamba cache order them), and the carried states of finished requests to drop."""
    rows: dict[int, dict[str, Any]] = {}
    evict: list[Any] = [("carry", rid) for rid in (model_input.finished_requests_ids or [])]
    row = 0
    for metadata in seq_group_metadata_list:
        plan = getattr(metadata, "prefix_state", None)
        for _ in metadata.seq_data:
            if plan is not None and metadata.is_prompt:
                start = plan["start"]
                rows[row] = dict(plan, request=metadata.request_id,
                                 captures=[(point - start, key) for point, key in plan["captures"]])
                evict.extend(plan["evict"])
            row += 1
    if not rows and not evict:
        return model_input
    return dataclasses.replace(model_input, prefix_state_plan={"rows": rows, "evict": evict})


class Store:
    """This process's checkpoints: key -> {layer: (conv state, recurrent state)}, in host memory."""

    def __init__(self) -> None:
        self.states: dict[Any, dict[int, tuple[Any, Any]]] = {}

    def save(self, key: Any, layer: Any, conv: Any, temporal: Any) -> None:
        self.states.setdefault(key, {})[id(layer)] = (conv.detach().to("cpu", copy=True),
                                                     temporal.detach().to("cpu", copy=True))

    def load(self, key: Any, layer: Any, conv: Any, temporal: Any) -> bool:
        saved = self.states.get(key, {}).get(id(layer))
        if saved is None:
            return False
        conv.copy_(saved[0])
        temporal.copy_(saved[1])
        return True

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layers in self.states.values() for pair in layers.values()
                   for t in pair)


STORE = Store()
_rows: dict[int, dict[str, Any]] = {}


def begin_step(plan: dict[str, Any] | None) -> None:
    """In execute_model, before the forward: this step's plan (on every rank, from the broadcast model input). A
    plan made with another PREFIX_STATE value than this process reads raises: the scheduler would skip tokens whose
    state no layer here restores."""
    global _rows
    _rows = {}
    if plan is None:
        return
    here = switches.value(SWITCH)
    for row in plan["rows"].values():
        if row.get("switch") != here:
            raise RuntimeError(
                f"prefix_state: the scheduler planned request {row.get('request')} with {SWITCH}="
                f"{row.get('switch')!r} but this worker reads {SWITCH}={here!r}: both sides must see the same "
                "value (set it once, in the server's environment)")
    for key in plan["evict"]:
        STORE.states.pop(tuple(key) if isinstance(key, list) else key, None)
    _rows = plan["rows"]


# -- the GatedDeltaNet layer ------------------------------------------------------------------------------------

def _rows_metadata(meta: Any, first: int, last: int, begin: int, stop: int) -> Any:
    """Attention metadata for batch rows [first, last) alone; for one prefill row, only its tokens [begin, stop)."""
    import torch

    names = {f.name for f in dataclasses.fields(meta)}
    qsl = meta.query_start_loc
    prefill = first < meta.num_prefills
    seq_lens = list(meta.seq_lens[first:last])
    context = meta.context_lens_tensor[first:last].clone()
    if prefill:
        context += begin
        seq_lens = [int(context[0]) + stop - begin]
        query_lens = [stop - begin]
        tokens = slice(int(qsl[first]) + begin, int(qsl[first]) + stop)
    else:
        query_lens = [1] * (last - first)
        tokens = slice(int(qsl[first]), int(qsl[last]))
    values: dict[str, Any] = {
        "num_prefills": 1 if prefill else 0,
        "num_prefill_tokens": query_lens[0] if prefill else 0,
        "num_decode_tokens": 0 if prefill else last - first,
        "slot_mapping": meta.slot_mapping[tokens],
        "seq_lens": seq_lens,
        "seq_lens_tensor": torch.tensor(seq_lens, dtype=meta.seq_lens_tensor.dtype, device=qsl.device),
        "max_prefill_seq_len": max(seq_lens) if prefill else 0,
        "max_decode_seq_len": 0 if prefill else max(seq_lens),
        "context_lens_tensor": context,
        "block_tables": meta.block_tables[first:last],
        "max_query_len": max(query_lens),
        "query_start_loc": torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=qsl.dtype,
                                        device=qsl.device),
        "seq_start_loc": torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=qsl.dtype,
                                      device=qsl.device),
        "use_cuda_graph": False,
    }
    values.update({name: None for name in names if name.startswith("_cached_") or "attn_bias" in name})
    return dataclasses.replace(meta, **{k: v for k, v in values.items() if k in names})


def _original(layer: Any, hidden_states: Any, meta: Any, conv_state: Any, temporal_state: Any) -> Any:
    layer._prefix_state_inner = True
    try:
        return layer.forward(hidden_states, meta, conv_state, temporal_state)
    finally:
        layer._prefix_state_inner = False


def gdn_forward(layer: Any, hidden_states: Any, attn_metadata: Any, conv_state: Any, temporal_state: Any) -> Any:
    """GatedDeltaNet.forward with this step's plan applied (dispatched from the top of the adapter's forward)."""
    import torch

    prefills = attn_metadata.num_prefills
    if not _rows or not any(row < prefills for row in _rows):
        return _original(layer, hidden_states, attn_metadata, conv_state, temporal_state)
    qsl = [int(x) for x in attn_metadata.query_start_loc[:prefills + 1]]
    outputs = []
    for row in range(prefills):
        conv, temporal = conv_state[row:row + 1], temporal_state[row:row + 1]
        tokens = qsl[row + 1] - qsl[row]
        plan = _rows.get(row)
        if plan is None:
            cuts: list[tuple[int, Any]] = []
        else:
            cuts = [(offset, key) for offset, key in plan["captures"] if 0 < offset <= tokens]
            if plan["fresh"]:
                conv.zero_()
                temporal.zero_()
            elif plan["restore"] is not None:
                key = tuple(plan["restore"])
                if not STORE.load(key, layer, conv, temporal):
                    raise RuntimeError(
                        f"prefix_state: checkpoint {key} is planned for restore (request {plan['request']}) but this "
                        "process does not hold it: the scheduler and this worker disagree on what was captured")
            elif plan["carry_in"] and not STORE.load(("carry", plan["request"]), layer, conv, temporal):
                raise RuntimeError(
                    f"prefix_state: request {plan['request']} continues its own previous chunk but this process "
                    "holds no state carried from it: the plan and this worker disagree")
        begin = 0
        for offset, key in [*cuts, (tokens, None)]:
            if offset > begin:
                part = slice(qsl[row] + begin, qsl[row] + offset)
                outputs.append(_original(layer, hidden_states[part],
                                         _rows_metadata(attn_metadata, row, row + 1, begin, offset), conv, temporal))
                begin = offset
            if key is not None:
                STORE.save(tuple(key), layer, conv, temporal)
        if plan is not None and plan["carry_out"]:
            STORE.save(("carry", plan["request"]), layer, conv, temporal)
    if attn_metadata.num_decode_tokens:
        rows = len(attn_metadata.seq_lens)
        outputs.append(_original(layer, hidden_states[qsl[prefills]:],
                                 _rows_metadata(attn_metadata, prefills, rows, 0, 0),
                                 conv_state[prefills:rows], temporal_state[prefills:rows]))
    return torch.cat(outputs)


# -- checks -----------------------------------------------------------------------------------------------------

HOOKS = {
    "vllm.core.scheduler:Scheduler.schedule": ("prefix_state.begin_schedule", "prefix_state.limit_hit",
                                               "prefix_state.attach"),
    "vllm.worker.model_runner:ModelRunner.prepare_model_input": ("prefix_state.with_plan",),
    "vllm.worker.model_runner:ModelRunner.execute_model": ("prefix_state.begin_step",),
    "vllm.core.block.prefix_caching_block:PrefixCachingBlockAllocator._maybe_allocate_evicted_block_id": (
        "prefix_state.evicted",),
    "vllm.model_executor.models.qwen3_5:GatedDeltaNet.forward": ("gdn_forward",),
}
FIELDS = {"vllm.sequence:SequenceGroupMetadata": "prefix_state",
          "vllm.worker.model_runner:ModelInputForGPU": "prefix_state_plan"}


def missing_hooks() -> list[str]:
    """What the patched tree lacks of the above (preflight calls this): 'module:qualname: what' per gap."""
    import importlib
    import inspect

    def resolve(ref: str) -> Any:
        module, _, qualname = ref.partition(":")
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj

    gaps = []
    for ref, calls in HOOKS.items():
        source = inspect.getsource(resolve(ref))
        gaps.extend(f"{ref}: no call to {call}" for call in calls if call not in source)
    for ref, name in FIELDS.items():
        cls = resolve(ref)
        if name not in getattr(cls, "__struct_fields__", ()) and name not in getattr(cls, "__dataclass_fields__", {}):
            gaps.append(f"{ref}: no field {name}")
    return gaps
