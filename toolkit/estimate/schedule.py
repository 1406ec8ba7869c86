"""vLLM 0.6.3's scheduler with chunked prefill, simulated step by step: which tokens each engine step runs, and
when each request's first and last tokens come out, for closed-loop clients (each sends its next request the moment
its previous one ends, as the platform's benchmark does).

The policy is `Scheduler._schedule_chunked_prefill`'s: the running queue first, in its order (a decode takes one
token of the budget, a prefill in progress the rest of it, up to what it has left; the first that gets nothing ends
the pass), then the waiting queue (a new prefill takes what budget is left, up to its uncached prompt), within
`max_num_batched_tokens` tokens and `max_num_seqs` sequences a step. After a step the running queue is what it left
out, then the decodes it ran, the prefills it continued and the prefills it started, so a decode runs before a long
prefill's next chunk. A prefix-cache hit is known when the request is first scheduled: its cached tokens
are never computed, and a fully cached prompt still computes its last token (vLLM recomputes it to sample). A
request's first token comes out of the step that computes the last piece of its prompt; each later step that runs it
gives one more. Without chunked prefill (`Limits.chunked` off) the policy is 0.6.3's default one: a step prefills
whole waiting prompts while they fit and then runs nothing else, or else decodes the running sequences. Preemption,
swapping and beam search are not simulated: the platform's workloads at the recipe's
`max-num-seqs` fit the KV cache (lint's kv-cache rule says when they would not).

What a step costs is the caller's: `simulate` takes a function from a `Step` to seconds (toolkit.estimate.device
prices the served path's operations for it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from toolkit.bench.metrics import RequestRecord


@dataclass(frozen=True)
class Request:
    """One request of a workload: its prompt, the part of it the prefix cache holds when it arrives, its answer."""

    prompt_tokens: int
    max_tokens: int
    cached_tokens: int = 0
    conversation: str = "c0"
    turn: int = 0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.max_tokens < 1:
            raise ValueError(f"a request needs a prompt and an answer of a token or more, not {self}")
        if not 0 <= self.cached_tokens <= self.prompt_tokens:
            raise ValueError(f"cached tokens {self.cached_tokens} outside the prompt's {self.prompt_tokens}")


@dataclass(frozen=True)
class Chunk:
    """A prefill's piece in one step: `tokens` computed after `context` tokens already in the cache."""

    tokens: int
    context: int


@dataclass(frozen=True)
class Step:
    """What one engine step runs: each decoding sequence's context length, each prefill chunk."""

    decodes: tuple[int, ...] = ()  # each one's length with the token it computes
    prefills: tuple[Chunk, ...] = ()

    @property
    def tokens(self) -> int:
        return len(self.decodes) + sum(c.tokens for c in self.prefills)


@dataclass(frozen=True)
class Limits:
    """The scheduler's budget per step (the served argv's --max-num-batched-tokens and --max-num-seqs)."""

    max_num_batched_tokens: int
    max_num_seqs: int
    chunked: bool = True  # --enable-chunked-prefill; off, vLLM 0.6.3's default policy (see `simulate`)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError(f"the budget must allow a token and a sequence a step: {self}")


@dataclass
class _Running:
    request: Request
    record: RequestRecord
    client: int
    computed: int  # prompt tokens in the cache (the hit included)
    produced: int = 0

    @property
    def prefilling(self) -> bool:
        return self.computed < self.request.prompt_tokens


@dataclass
class Timeline:
    """What a simulated run gives: every request as a client would have recorded it, the run's wall time and the
    steps the engine ran."""

    records: list[RequestRecord]
    wall_s: float
    steps: list[Step] = field(default_factory=list)


StepCost = Callable[[Step], float]


def simulate(clients: Sequence[Sequence[Request]], limits: Limits, cost: StepCost,
             max_steps: int = 1_000_000) -> Timeline:
    """Each client's requests in order, all clients starting at 0; the engine steps until every request ends."""
    pending = [deque(requests) for requests in clients]
    waiting: deque[_Running] = deque()
    running: list[_Running] = []
    records: list[RequestRecord] = []
    steps: list[Step] = []
    now = 0.0
    counter = 0

    def arrive(client: int) -> None:
        nonlocal counter
        if not pending[client]:
            return
        request = pending[client].popleft()
        record = RequestRecord(request_id=f"r{counter}", conversation=request.conversation, turn=request.turn,
                               worker=client, t0=now, prompt_tokens=request.prompt_tokens,
                               cached_tokens=request.cached_tokens, cache_reported=True)
        counter += 1
        records.append(record)
        # vLLM recomputes a fully cached prompt's last token: its logits are what the first token is sampled from
        waiting.append(_Running(request, record, client, min(request.cached_tokens, request.prompt_tokens - 1)))

    for client in range(len(clients)):
        arrive(client)
    while running or waiting:
        if len(steps) >= max_steps:
            raise RuntimeError(f"the simulation ran {max_steps} steps without ending: a budget that admits nothing?")
        budget, seqs = limits.max_num_batched_tokens, 0
        decodes: list[tuple[_Running, int]] = []
        chunks: list[tuple[_Running, Chunk]] = []
        if not limits.chunked and waiting and len(running) < limits.max_num_seqs:
            # 0.6.3's default policy: whole prompts while they fit, and a step that prefills decodes nothing
            while (waiting and len(running) + len(chunks) < limits.max_num_seqs
                   and waiting[0].request.prompt_tokens - waiting[0].computed <= budget):
                seq = waiting.popleft()
                take = seq.request.prompt_tokens - seq.computed
                chunks.append((seq, Chunk(take, seq.computed)))
                budget -= take
            if not chunks:
                raise RuntimeError(f"a prompt of {waiting[0].request.prompt_tokens} tokens does not fit "
                                   f"--max-num-batched-tokens {limits.max_num_batched_tokens} without chunked prefill")
            budget = 0  # nothing else runs beside them
        for seq in running:
            if seqs >= limits.max_num_seqs or budget == 0:
                break
            if seq.prefilling:
                take = min(seq.request.prompt_tokens - seq.computed, budget)
                chunks.append((seq, Chunk(take, seq.computed)))
            else:
                take = 1
                decodes.append((seq, seq.request.prompt_tokens + seq.produced))
            budget -= take
            seqs += 1
        from_running = 0 if not limits.chunked else len(chunks)
        while limits.chunked and waiting and budget > 0 and seqs < limits.max_num_seqs:
            seq = waiting.popleft()
            take = min(seq.request.prompt_tokens - seq.computed, budget)
            chunks.append((seq, Chunk(take, seq.computed)))
            budget -= take
            seqs += 1
        # the running queue's next order, as 0.6.3 rebuilds it: what this step left out stays in front, then the
        # decodes it ran, the prefills it continued, the prefills it started
        scheduled = {id(seq) for seq, _ in decodes} | {id(seq) for seq, _ in chunks}
        running = ([seq for seq in running if id(seq) not in scheduled] + [seq for seq, _ in decodes]
                   + [seq for seq, _ in chunks[:from_running]] + [seq for seq, _ in chunks[from_running:]])
        step = Step(tuple(context for _, context in decodes), tuple(chunk for _, chunk in chunks))
        if step.tokens == 0:
            raise RuntimeError("a step with nothing to run: the budget admits no token")
        steps.append(step)
        now += cost(step)
        ended: list[_Running] = []
        for seq, _ in decodes:
            seq.produced += 1
            seq.record.content_times.append(now)
            if seq.produced == seq.request.max_tokens:
                ended.append(seq)
        for seq, chunk in chunks:
            seq.computed += chunk.tokens
            if not seq.prefilling:  # its last prompt piece ran: the first token comes out of this step
                seq.produced = 1
                seq.record.ttft = now - seq.record.t0
                seq.record.content_times.append(now)
                if seq.request.max_tokens == 1:
                    ended.append(seq)
        for seq in ended:
            running.remove(seq)
            seq.record.ok = True
            seq.record.e2e = now - seq.record.t0
            seq.record.last_content = now
            seq.record.completion_tokens = seq.produced
            seq.record.finish_reason = "length"
            arrive(seq.client)
    return Timeline(records, now, steps)
