"""prefix-cache: the conversations' answers with the prefix cache on equal those of a fresh server without it (two
at a time and one at a time), by token id: the cache changes no token and no request borrows another's state."""

from __future__ import annotations

from toolkit.bench import client
from toolkit.bench.metrics import RequestRecord
from toolkit.rehearsal.checks.base import RehearsalCheck, Run
from toolkit.rehearsal.model import BATCH_TOKENS, COMPARED_DTYPE, TIE_NATS, Check
from toolkit.rehearsal.requests import LONG_SYSTEM, problems, send
from toolkit.rehearsal.servers import Live

NOT_CACHED = "the run config serves without the prefix cache: nothing to compare"


def conversations() -> list[client.Conversation]:
    """Two conversations of three turns, each prompt longer than the batch-token budget (chunked prefill beside
    the other's decodes), the later turns repeating the earlier ones' blocks."""
    return [client.Conversation(f"conversation-{k}", [
        client.Turn(f"Turn {t} of conversation {k}: what does the cache keep now?") for t in range(3)],
        system=f"Conversation {k}. {LONG_SYSTEM}") for k in range(2)]


def cached_run(run: Run, live: Live) -> list[RequestRecord]:
    """The conversations at concurrency 2 on the cache-on server, sent once for every check that reads them."""
    records: list[RequestRecord] = live.once("cache on, two at a time", lambda: send(
        run.stage, live.server, conversations(), 2, "cache on, two at a time", stream=False))
    return records


def _tie(a: RequestRecord, b: RequestRecord) -> tuple[int, float] | None:
    """Where two answers part (token index, and how far apart the two tokens were in logprob in each run), when
    both runs had the other's token within TIE_NATS of their own there: numerics, not a wrong state."""
    tokens_a, tokens_b = _tokens(a), _tokens(b)
    j = next((i for i, (x, y) in enumerate(zip(tokens_a, tokens_b, strict=False)) if x != y), None)
    if j is None:
        return None
    gaps = [side[j]["logprob"] - side[j]["top"].get(other, float("-inf")) for side, other in
            ((a.logprobs, tokens_b[j]), (b.logprobs, tokens_a[j]))]
    gap = max(abs(g) for g in gaps)
    return (j, gap) if gap <= TIE_NATS else None


def _tokens(record: RequestRecord) -> list[str]:
    return [t["token"] for t in record.logprobs]


def compare(mine: list[RequestRecord], theirs: list[RequestRecord]) -> tuple[list[str], list[str]]:
    """(answers that differ, answers that part at a near-tie) between two runs of the conversations; after a
    near-tie a conversation's later turns are not compared (their prompts hold the other reply)."""
    other = {(r.conversation, r.turn): r for r in theirs}
    differ, ties, parted = [], [], set()
    for r in sorted(mine, key=lambda r: (r.conversation, r.turn)):
        name = f"{r.conversation} turn {r.turn}"
        o = other.get((r.conversation, r.turn))
        if r.conversation in parted:
            continue
        if o is None or not (r.ok and o.ok):
            differ.append(f"{name} (a request failed)")
        elif (r.reasoning, r.reply, r.tool_calls, _tokens(r)) != (o.reasoning, o.reply, o.tool_calls, _tokens(o)):
            tie = _tie(r, o)
            if tie is None:
                differ.append(name)
            else:
                ties.append(f"{name} at token {tie[0]} (logprobs {tie[1]:.4f} apart)")
                parted.add(r.conversation)
    return differ, ties


def prefix_cache_check(cached: list[RequestRecord], alone: list[RequestRecord],
                       together: list[RequestRecord]) -> Check:
    """The answers with the cache on against those without it, two at a time and one at a time; the cache-off
    servers must have cached nothing."""
    found = [f"{r.conversation} turn {r.turn}: {p}" for r in cached for p in problems(r, False, visible=False)]
    short = [r for r in cached if r.ok and r.prompt_tokens <= BATCH_TOKENS]
    if short:
        found.append(f"{len(short)} prompt(s) not longer than the {BATCH_TOKENS}-token budget: nothing chunked")
    if found:
        return Check("prefix-cache", False, "; ".join(found))
    # the servers compared against are the cache-off ones: one that reports a hit caches with the flag off, and
    # then compares the cache with itself
    cached_off = [f"{r.conversation} turn {r.turn} ({r.cached_tokens} cached)" for r in (*together, *alone)
                  if r.ok and r.cached_tokens]
    if cached_off:
        found.append("the servers without --enable-prefix-caching reported cached tokens: " + ", ".join(cached_off))
    noted = []
    for label, records in (("without the prefix cache, two at a time", together),
                           ("one at a time on a fresh server without the prefix cache", alone)):
        differ, ties = compare(cached, records)
        if differ:
            found.append(f"answers differ from those served {label}: {', '.join(differ)}")
        if ties:
            noted.append(f"parted from those served {label} only at a near-tie: {', '.join(ties)}")
    said = f" ({'; '.join(noted)})" if noted else ""
    return Check("prefix-cache", not found, "; ".join(found) + said if found else (
        f"{len(cached)} answers (prompts of {min(r.prompt_tokens for r in cached)}-"
        f"{max(r.prompt_tokens for r in cached)} tokens, chunked by {BATCH_TOKENS}, {COMPARED_DTYPE}) at concurrency "
        f"2 equal to those without the cache, two at a time and one at a time{said}"))


class PrefixCache(RehearsalCheck):
    name = "prefix-cache"
    summary = "cache on = cache off, one and two at a time, by token id"
    servers = ("cache-on", "cache-off")

    def not_applicable(self) -> str | None:
        return None if self.run.caching else NOT_CACHED

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.cached: list[RequestRecord] | None = None
        self.alone: list[RequestRecord] | None = None
        self.together: list[RequestRecord] | None = None

    def on(self, server: str, live: Live) -> None:
        if server == "cache-on":
            self.cached = cached_run(self.run, live)
            return
        stage = self.run.stage
        self.alone = send(stage, live.server, conversations(), 1, "cache off, one at a time", stream=False)
        self.together = send(stage, live.server, conversations(), 2, "cache off, two at a time", stream=False)

    def verdict(self) -> Check:
        if self.cached is None or self.alone is None or self.together is None:
            return self.unsent()
        return prefix_cache_check(self.cached, self.alone, self.together)
