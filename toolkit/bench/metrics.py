"""The evaluator's metrics, recomputed from per-request records (definitions: ../shared/BENCH.md sections 1, 4.1).

Percentiles are numpy's "linear" method; aggregates divide by the run's wall time, failures included in the
success rate's denominator; the official replay score uses uncached input.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# the official TTFT buckets by prompt length (tokens)
BUCKETS = (("lt_6k", 0, 6_000), ("6k_16k", 6_000, 16_000), ("16k_32k", 16_000, 32_000),
           ("32k_64k", 32_000, 64_000), ("64k_128k", 64_000, 128_000), ("128k_256k", 128_000, 256_000),
           ("ge_256k", 256_000, math.inf))
FAILURE_CLASSES = ("http_4xx", "http_5xx", "connection", "timeout", "stream_aborted", "no_usage", "error_event")
# the public proxy's weights: output term, uncached input, cache
PROXY = (16.796, 2.799, 0.56)
# a stream whose tokens after the first all arrived within this of each other came in one burst: no decoder runs
# that fast (64 tokens in 5 ms is 12,800 tokens/s for one request); the client or the server's stream was starved
BURST_S = 0.005
BURST_MIN_TOKENS = 4


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds relative to the run's start."""

    request_id: str
    conversation: str
    turn: int
    worker: int
    t0: float
    ok: bool = False
    status: int | None = None
    failure: str | None = None  # one of FAILURE_CLASSES
    message: str = ""
    ttft: float | None = None
    e2e: float | None = None
    last_content: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    content_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cache_reported: bool = False
    completion_tokens: int = 0
    finish_reason: str | None = None
    reply: str = ""
    reasoning: str = ""  # the streamed reasoning_content (a reasoning parser's split)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # {"name", "arguments"}: the deltas joined
    # with Settings.logprobs: each generated token {"token", "logprob", "top": {token: logprob}}
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def output_tps_e2e(self) -> float | None:
        """The official per-request Output TPS: tokens over the whole request, TTFT included."""
        return self.completion_tokens / self.e2e if self.ok and self.e2e else None

    @property
    def output_tps_decode(self) -> float | None:
        """Tokens over the time after the first content event (the prior art's rate)."""
        if not self.ok or self.e2e is None or self.ttft is None or self.e2e <= self.ttft:
            return None
        return self.completion_tokens / (self.e2e - self.ttft)

    @property
    def burst(self) -> bool:
        """All of the stream's tokens after the first arrived in one burst (its decode rate then measures nothing)."""
        if not self.ok or self.completion_tokens < BURST_MIN_TOKENS or not self.content_times:
            return False
        rest = self.content_times[1:]
        return not rest or max(rest) - min(rest) < BURST_S

    @property
    def bucket(self) -> str:
        return next(name for name, low, high in BUCKETS if low <= self.prompt_tokens < high)

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(uncached_tokens=self.uncached_tokens, output_tps_e2e=self.output_tps_e2e,
                    output_tps_decode=self.output_tps_decode, bucket=self.bucket, burst=self.burst)
        return data


def percentile(values: Sequence[float], p: float) -> float | None:
    """numpy's default ("linear"): v[k0] + (v[k0 + 1] - v[k0]) * (k - k0) with k = (n - 1) * p / 100."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    low = math.floor(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def official_score(output_tpm: float, uncached_input_tpm: float, cached_tpm: float) -> float:
    """The replay module's score, recovered from the evaluator's logs: 0.36 (30 out + 5 uncached + cached) TPM."""
    return 0.36 * (30 * output_tpm + 5 * uncached_input_tpm + cached_tpm)


def weighted_throughput(output_term: float, uncached_input_tps: float, cache_tps: float) -> float:
    return PROXY[0] * output_term + PROXY[1] * uncached_input_tps + PROXY[2] * cache_tps


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


def summarize(records: Iterable[RequestRecord], wall_s: float) -> dict[str, Any]:
    """Every per-run metric of BENCH.md 4.1, as one flat dict."""
    records = list(records)
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    e2e_tps = [v for r in ok if (v := r.output_tps_e2e) is not None]
    decode_tps = [v for r in ok if (v := r.output_tps_decode) is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(r.completion_tokens for r in ok)
    wall = wall_s if wall_s > 0 else math.nan
    out: dict[str, Any] = {
        "requests": len(records), "successful": len(ok), "failed": len(records) - len(ok),
        "success_rate": len(ok) / len(records) if records else None,
        "failure_classes": {c: n for c in FAILURE_CLASSES if (n := sum(1 for r in records if r.failure == c))},
        "cache_reported": all(r.cache_reported for r in ok) if ok else None,
        "total_prompt_tokens": prompt, "total_cached_tokens": cached, "total_uncached_tokens": prompt - cached,
        "total_output_tokens": output, "cache_hit_rate": cached / prompt if prompt else None,
        "wall_time_s": wall_s,
        "ttft_p50_ms": _ms(percentile(ttfts, 50)), "ttft_p90_ms": _ms(percentile(ttfts, 90)),
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "output_tps_e2e_p10": percentile(e2e_tps, 10), "output_tps_e2e_p50": percentile(e2e_tps, 50),
        "output_tps_decode_p10": percentile(decode_tps, 10), "output_tps_decode_p50": percentile(decode_tps, 50),
        "output_tps_agg": output / wall, "uncached_input_tps_agg": (prompt - cached) / wall,
        "cache_tps_agg": cached / wall,
        "stream_burst_requests": sum(1 for r in ok if r.burst),
    }
    # a burst makes its request's decode rate tokens over ~0 s: the decode percentiles then measure the stream's
    # delivery, not the decoder (the official, end-to-end rate is unaffected)
    out["output_tps_decode_unreliable"] = out["stream_burst_requests"] > 0
    for name, _, _ in BUCKETS:
        times = [r.ttft for r in ok if r.bucket == name and r.ttft is not None]
        if times:
            out[f"ttft_{name}_p50_ms"] = _ms(percentile(times, 50))
            out[f"ttft_{name}_p90_ms"] = _ms(percentile(times, 90))
            out[f"ttft_{name}_count"] = len(times)
    agg = out["output_tps_agg"], out["uncached_input_tps_agg"], out["cache_tps_agg"]
    out["official_replay_score"] = official_score(agg[0] * 60, agg[1] * 60, agg[2] * 60)
    out["weighted_throughput_agg_output"] = weighted_throughput(*agg)
    p10 = out["output_tps_e2e_p10"]
    out["weighted_throughput_p10_output"] = weighted_throughput(p10, agg[1], agg[2]) if p10 is not None else None
    return out


@dataclass(frozen=True)
class Target:
    metric: str
    op: str  # ">=" or "<="
    value: float
    why: str

    def check(self, summary: dict[str, Any]) -> tuple[bool | None, Any]:
        got = summary.get(self.metric)
        if got is None or (isinstance(got, float) and math.isnan(got)):
            return None, got
        return (got >= self.value if self.op == ">=" else got <= self.value), got


# the official targets, each against a named metric so the definition in use is always visible
TARGETS = (
    Target("success_rate", ">=", 0.99, "success rate >= 99%"),
    Target("cache_hit_rate", ">=", 0.50, "cache hit rate >= 50%"),
    Target("ttft_p90_ms", "<=", 5000.0, "TTFT P90 <= 5 s"),
    Target("output_tps_e2e_p10", ">=", 20.0, "Output TPS P10 >= 20 (official: end-to-end, TTFT included)"),
    Target("weighted_throughput_p10_output", ">=", 8000.0,
           "weighted token throughput >= 8000 (proxy 16.796 x Output TPS P10 + 2.799 x uncached input/s + "
           "0.56 x cached/s)"),
)
