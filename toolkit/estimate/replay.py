"""The platform's replay predicted: its recorded requests (`toolkit.bench.workloads.recorded`) sent one at a time in
their order, each served by the simulated scheduler with the variant's step costs, inside the replay's time budget;
the platform's metrics over every request, the ones never served counted as failures.

What the estimate has to assume, each said in its report:
- **A length no log printed** (the requests after the budget ran out, and those refused before tokenising) is the
  mean of the lengths the file gives (prompt and output apart).
- **The prefix cache:** a request finds in the cache the longest prompt among the THREAD_WINDOW requests before it
  that is shorter than its own (an earlier turn of its thread: the exact checkpoints restore a prompt's state at its
  end), in whole blocks. THREAD_WINDOW is the threads' median length (about 768 threads, a median of three requests
  each: the replay's README), not a value fitted to the logged hit rate, which it is checked against
  (`LOGGED_HIT_RATE`). Prompts the threads share across threads (a common system prompt and tool schemas) are not
  modelled, nor evictions: the KV cache holds several full-length sequences and the replay runs one at a time.
- **A completion limit that does not fit** the context is refused with vLLM 0.6.3's HTTP 400, unless the recipe
  applies the transform that cuts it to the room left (`COMPLETION_LIMIT_CUT`); a prompt that fills the context alone
  is refused either way. A refused request takes no time.
- **The budget:** a request dispatched at or after it never started; one still running when it ends is cut. Both
  are failures (the platform counts the first as not served; the second's stream ends with the replay).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from toolkit.bench.metrics import BUCKETS, RequestRecord, summarize
from toolkit.bench.workloads import Recorded
from toolkit.estimate.predict import BLOCK_TOKENS
from toolkit.estimate.schedule import Limits, Request, Step, simulate

BUDGET_S = 46_800.0  # the platform's replay budget (../shared/platform-replay/README.md)
THREAD_WINDOW = 3  # the threads' median number of requests
LOGGED_HIT_RATE = 10_076_176 / 17_374_285  # prompt tokens served from the cache over submission 694's successes
COMPLETION_LIMIT_CUT = "openai-completion-limit-fits"  # layers/corex-3.2.3.yaml's transform


@dataclass(frozen=True)
class Served:
    """How the variant serves the replay: its context, whether it caches prefixes and cuts a completion limit."""

    max_model_len: int
    prefix_caching: bool
    cuts_completion_limit: bool


@dataclass
class ReplayPrediction:
    """The replay as the platform would score it, with what the estimate filled in and assumed."""

    metrics: dict[str, Any]
    records: list[RequestRecord]
    dispatched: int
    finished: int
    refused: int
    cut: int
    wall_s: float
    said: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        keys = ("requests", "successful", "success_rate", "failure_classes", "ttft_p50_ms", "ttft_p90_ms",
                "output_tps_e2e_p10", "output_tps_e2e_p50", "output_tps_agg", "cache_hit_rate",
                "official_replay_score")
        buckets = {name: {"count": self.metrics[f"ttft_{name}_count"], "p50_ms": self.metrics[f"ttft_{name}_p50_ms"],
                          "p90_ms": self.metrics[f"ttft_{name}_p90_ms"]}
                   for name, _, _ in BUCKETS if f"ttft_{name}_count" in self.metrics}
        return {**{k: self.metrics.get(k) for k in keys}, "ttft_buckets": buckets, "dispatched": self.dispatched,
                "finished": self.finished,
                "refused": self.refused, "cut_by_budget": self.cut, "wall_s": self.wall_s,
                "logged_hit_rate": LOGGED_HIT_RATE, "said": self.said}


def filled(rows: Sequence[Recorded]) -> tuple[list[tuple[int, int, int | None]], list[str]]:
    """Each row's (prompt tokens, output tokens, completion limit), a missing length filled with the mean of the
    known ones, and what was filled."""
    prompts = [r.prompt_tokens for r in rows if r.prompt_tokens is not None]
    outputs = [r.output_tokens for r in rows if r.output_tokens is not None]
    if not prompts or not outputs:
        raise ValueError("the replay file gives no prompt length or no output length to fill the others from")
    prompt_mean, output_mean = round(statistics.fmean(prompts)), round(statistics.fmean(outputs))
    out = [(r.prompt_tokens or prompt_mean, r.output_tokens or output_mean, r.completion_limit) for r in rows]
    said = []
    if len(prompts) < len(rows):
        said.append(f"{len(rows) - len(prompts)} of {len(rows)} prompt lengths are not in the file: each is the "
                    f"known ones' mean, {prompt_mean:,} tokens")
    if len(outputs) < len(rows):
        said.append(f"{len(rows) - len(outputs)} of {len(rows)} output lengths are not in the file: each is the "
                    f"known ones' mean, {output_mean:,} tokens")
    return out, said


def cached(prompts: Sequence[int], window: int = THREAD_WINDOW) -> list[int]:
    """Each prompt's cache hit: the longest of the `window` prompts before it that is shorter, in whole blocks."""
    hits = []
    for i, prompt in enumerate(prompts):
        earlier = [p for p in prompts[max(0, i - window):i] if p < prompt]
        hits.append(max(earlier, default=0) // BLOCK_TOKENS * BLOCK_TOKENS)
    return hits


def _answer(prompt: int, output: int, limit: int | None, served: Served) -> int | None:
    """The tokens a request is answered with as the variant serves it, or None where vLLM refuses it."""
    room = served.max_model_len - prompt
    if room < 1 or (limit is not None and limit > room and not served.cuts_completion_limit):
        return None
    return max(min(output, room, limit or output), 1)


def longest(rows: Sequence[Recorded], served: Served) -> int:
    """The longest sequence (prompt and answer) of a request the variant serves: the deepest context it runs."""
    shapes, _ = filled(rows)
    served_lengths = [prompt + answer for prompt, output, limit in shapes
                      if (answer := _answer(prompt, output, limit, served)) is not None]
    return max(served_lengths, default=0)


def predict(rows: Sequence[Recorded], served: Served, limits: Limits, cost: Callable[[Step], float],
            budget_s: float = BUDGET_S) -> ReplayPrediction:
    shapes, said = filled(rows)
    hits = cached([p for p, _, _ in shapes]) if served.prefix_caching else [0] * len(shapes)
    records: dict[int, RequestRecord] = {}
    runnable: list[tuple[int, Request]] = []
    refused = 0
    for row, (prompt, output, limit), hit in zip(rows, shapes, hits, strict=True):
        answer = _answer(prompt, output, limit, served)
        if answer is None:
            refused += 1
            asked = prompt + (limit or 0)
            records[row.index] = RequestRecord(row.request_id or f"r{row.index}", "replay", row.index, 0, 0.0,
                                               status=400, failure="http_4xx", prompt_tokens=prompt,
                                               message=f"{asked} tokens asked of a {served.max_model_len}-token "
                                               "context")
            continue
        runnable.append((row.index, Request(prompt, answer, min(hit, prompt), f"r{row.index}", 0)))
    timeline = simulate([[request for _, request in runnable]], limits, cost)
    finished = cut = dispatched = 0
    ends = [0.0]  # when each runnable request ends: a refused one is sent at the end of the one before it
    for (index, _), record in zip(runnable, timeline.records, strict=True):
        record.request_id = rows[index].request_id or f"r{index}"
        ends.append(record.t0 + (record.e2e or 0.0))
        if record.t0 >= budget_s:
            record.ok, record.failure = False, "timeout"
            record.message = "not dispatched inside the budget"
        else:
            dispatched += 1
            if record.e2e is not None and record.t0 + record.e2e > budget_s:
                cut += 1
                record.ok, record.failure = False, "timeout"
                record.message = "still running when the budget ended"
            else:
                finished += 1
        records[index] = record
    position = 0
    for row in rows:  # a refused request is sent when the one before it ended: after the budget, it never was
        record = records[row.index]
        if record.failure == "http_4xx":
            if ends[position] >= budget_s:
                refused -= 1
                record.failure, record.status, record.message = "timeout", None, "not dispatched inside the budget"
            record.t0 = ends[position]
        else:
            position += 1
    ordered = [records[row.index] for row in rows]
    wall = min(timeline.wall_s, budget_s)
    metrics = summarize(ordered, wall)
    hit_rate = metrics["cache_hit_rate"] or 0.0  # over the requests served, as the platform counts it
    said.append(f"prefix cache: each request hits the longest shorter prompt among the {THREAD_WINDOW} before it "
                f"(the threads' median length): {hit_rate:.1%} of the served prompt tokens, against "
                f"{LOGGED_HIT_RATE:.1%} logged (submission 694)" if served.prefix_caching else
                "prefix caching is off: every prompt is computed whole")
    if refused:
        said.append(f"{refused} request(s) refused for the context ({served.max_model_len:,} tokens"
                    + (", a completion limit cut to the room left" if served.cuts_completion_limit else
                       ", a completion limit that does not fit refused as vLLM 0.6.3 does") + ")")
    return ReplayPrediction(metrics, ordered, dispatched + refused, finished, refused, cut, wall, said)
