"""cache-hits: every later turn of the conversations reports cached tokens on the server with the prefix cache on;
the hit rate as the evaluator computes it (cached over prompt tokens)."""

from __future__ import annotations

from toolkit.bench.metrics import RequestRecord
from toolkit.rehearsal.checks.base import RehearsalCheck, Run
from toolkit.rehearsal.checks.prefix_cache import NOT_CACHED, cached_run
from toolkit.rehearsal.model import Check, Rehearsal
from toolkit.rehearsal.servers import Live


def cache_hits_check(rehearsal: Rehearsal, cached: list[RequestRecord]) -> Check:
    ok = [r for r in cached if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    rehearsal.hit_rate = sum(r.cached_tokens for r in ok) / prompt if prompt else None
    rate = f"{rehearsal.hit_rate:.2f}" if rehearsal.hit_rate is not None else "n/a"
    missed = [f"{r.conversation} turn {r.turn} ({r.prompt_tokens} prompt tokens)" for r in ok
              if r.turn > 0 and r.cached_tokens == 0]
    if len(ok) < len(cached):
        return Check("cache-hits", False, f"{len(cached) - len(ok)} of {len(cached)} requests failed")
    return Check("cache-hits", not missed, (f"no cached tokens on {', '.join(missed)}; " if missed else
                                            "every later turn hit the cache; ") + f"cache hit rate {rate} (cached "
                 "over prompt tokens, as the evaluator computes it)")


class CacheHits(RehearsalCheck):
    name = "cache-hits"
    summary = "every later turn hits the cache; the hit rate"
    servers = ("cache-on",)

    def not_applicable(self) -> str | None:
        return None if self.run.caching else NOT_CACHED

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.cached: list[RequestRecord] | None = None

    def on(self, server: str, live: Live) -> None:
        self.cached = cached_run(self.run, live)

    def verdict(self) -> Check:
        return cache_hits_check(self.run.stage.rehearsal, self.cached) if self.cached is not None else self.unsent()
