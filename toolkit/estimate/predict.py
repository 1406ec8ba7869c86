"""A variant's counted steps priced on the device, and a workload's run simulated with them: what `toolkit bench`
would report of it on the target.

A step's time is its slowest rank's, each operation priced by `device.seconds`. The census counts a few step shapes
(`count.Plan`); any other step is priced from them:
- a decode-only step of b sequences: the counted decodes of b sequences, linear between the counted batch sizes
  and extended along the last segment beyond them (with one counted size, that size's: a decode reads the same
  weights);
- a step with prefill tokens: the counted single prefills, linear in the step's tokens between the counted lengths
  (and beyond the longest, along its last segment), its decodes counted as prefill tokens (one forward runs them
  all, and the served MoE and GatedDeltaNet paths take their multi-token branch for it).
What a step's contexts add is counted at the contexts the census ran (`count.contexts_for`: each power of two the
workload's longest sequence passes and just below it), linear between them: a prefill chunk's depth by its counted
chunk's extra time per token over a cold chunk (its prefix attention), times the chunk's tokens; a decode's context
by one sequence's counted decode there over its decode at the short context, unless the calibration has the target's
measured decode against context (`decode_context`), which then prices it (the same for every variant). Not
modelled: host work outside the step (the scheduler, the front end, streaming), and the variance of routing (each
counted step routes its own random tokens).

Prompt lengths come from the workload's text at CHARS_PER_TOKEN, unless given: a workload's token counts are the
served tokenizer's, which this machine does not have.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from toolkit.bench.client import Conversation
from toolkit.bench.metrics import summarize
from toolkit.errors import ToolkitError
from toolkit.estimate.count import Counted, CountedStep, within
from toolkit.estimate.device import Calibration, Device, Op, seconds
from toolkit.estimate.schedule import Limits, Request, Step, Timeline, simulate

CHARS_PER_TOKEN = 4.0  # English text and JSON through a BPE vocabulary of this size: a stated approximation
BLOCK_TOKENS = 16  # a prefix-cache hit is whole KV blocks


def regions(ops: Sequence[Op], device: Device, calibration: Calibration) -> dict[str, dict[str, float]]:
    """Per region (its own operations, not its children's): seconds, launches, FLOPs, bytes."""
    out: dict[str, dict[str, float]] = {}
    for op in ops:
        entry = out.setdefault(op.region, {"seconds": 0.0, "launches": 0.0, "flops": 0.0, "bytes": 0.0})
        entry["seconds"] += seconds(op, device, calibration)
        entry["launches"] += op.calls
        entry["flops"] += op.flops
        entry["bytes"] += op.bytes
    return out


def inclusive(own: dict[str, dict[str, float]], region: str) -> float:
    """A region's seconds with everything that ran inside it (its dotted children)."""
    return sum(v["seconds"] for name, v in own.items() if within(name, region))


def _line(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise linear through `points` (sorted by x), extended along the end segments."""
    if len(points) == 1:
        return points[0][1] * (x / points[0][0] if points[0][0] else 1.0)
    xs = [p[0] for p in points]
    i = min(max(bisect.bisect_left(xs, x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


Shape = tuple[str, int]  # ("decode", sequences), ("prefill", tokens), or a counted context's ("chunk"|"context", depth)


def shape_of(step: CountedStep) -> Shape | None:
    """The shape a counted step prices: a decode of b sequences, one prefill alone (a batch's joint prefill is not
    used), or at a counted context its chunk or one of its decodes."""
    if step.depth:
        if step.prefills and not step.decodes:
            return ("chunk", step.depth)
        return ("context", step.depth) if len(step.decodes) == 1 and not step.prefills else None
    if step.decodes and not step.prefills:
        return ("decode", len(step.decodes))
    if len(step.prefills) == 1 and not step.decodes:
        return ("prefill", step.prefills[0])
    return None


class StepCost:
    """Seconds for any scheduler step, from the variant's counted steps (see the module's rules). Each shape's time
    is each rank's cheapest count of it (one-off work of a path's first call is left out), on the slowest rank."""

    def __init__(self, counted: Counted, device: Device, calibration: Calibration) -> None:
        self.device, self.calibration = device, calibration
        cheapest: dict[Shape, dict[int, tuple[float, list[Op]]]] = {}
        where: dict[Shape, int] = {}  # a counted context's decode context, or its chunk's tokens
        for step in counted.steps:
            shape = shape_of(step)
            if shape is None:
                continue
            if shape[0] == "context":
                where[shape] = min(where.get(shape, step.decodes[0]), step.decodes[0])
            elif shape[0] == "chunk":
                where[shape] = step.prefills[0]
            for rank, ops in step.ranks.items():
                priced = sum(seconds(op, device, calibration) for op in ops)
                best = cheapest.setdefault(shape, {})
                if rank not in best or priced < best[rank][0]:
                    best[rank] = (priced, ops)
        self.ops = {shape: ranks[min(ranks)][1] for shape, ranks in sorted(cheapest.items())}  # rank 0's
        points = {shape: max(priced for priced, _ in ranks.values()) for shape, ranks in sorted(cheapest.items())}
        self.decode_points = [(float(n), t) for (kind, n), t in points.items() if kind == "decode"]
        # the context the census decoded its batches at: what a longer context adds is counted, or measured, from it
        contexts = [c for step in counted.steps if step.decodes and not step.prefills and not step.depth
                    for c in step.decodes]
        self.counted_context = float(min(contexts)) if contexts else 0.0
        self.prefill_points = [(float(n), t) for (kind, n), t in points.items() if kind == "prefill"]
        if not self.decode_points or not self.prefill_points:
            raise ToolkitError(f"the census in {counted.folder} counted no decode step or no single prefill: nothing "
                               "to price a step from", hint="its steps.json and census.log say what ran")
        # what a counted context adds: to one sequence's decode, and to a chunk per token of it (its prefix attention)
        one = self._decode(1)
        self.context_points = sorted((float(where[s]), t - one) for s, t in points.items() if s[0] == "context")
        self.depth_points = sorted((float(s[1]), (t - max(_line(self.prefill_points, where[s]), 0.0)) / where[s])
                                   for s, t in points.items() if s[0] == "chunk")

    def __call__(self, step: Step) -> float:
        return self.counted(step) + self.context(step)

    def _decode(self, sequences: int) -> float:
        if len(self.decode_points) == 1:  # one counted batch size: a decode reads the same weights for more
            return self.decode_points[0][1]
        return max(_line(self.decode_points, sequences), 0.0)

    def counted(self, step: Step) -> float:
        """The step's time from the counted shapes at the census's short contexts."""
        if not step.prefills:
            return self._decode(len(step.decodes))
        return max(_line(self.prefill_points, step.tokens), 0.0)

    def context(self, step: Step) -> float:
        """What its contexts add: each decode's, by the calibration's measured decode against context where it has
        one (the target's own figures; the count's are checked against them in benchmarks/estimate.py), else by the
        counted contexts; each prefill chunk's depth by the counted chunks (their extra per token, times its
        tokens). Nothing where the census counted no context."""
        measured = self.calibration.decode_context
        if measured is not None:
            extra = sum(measured.extra(c, self.counted_context) for c in step.decodes)
        else:
            extra = sum(self._counted_context(c) for c in step.decodes)
        if self.depth_points:
            line = [(0.0, 0.0), *self.depth_points]
            extra += sum(max(_line(line, chunk.context), 0.0) * chunk.tokens for chunk in step.prefills)
        return extra

    def _counted_context(self, context: float) -> float:
        """What one sequence's decode at `context` adds over the short context, by the counted contexts."""
        if not self.context_points:
            return 0.0
        return max(_line([(self.counted_context, 0.0), *self.context_points], context), 0.0)

    def decode_at(self, context: float) -> float:
        """One sequence's decode step at `context` as counted (the measured curve left out): what the count says."""
        return self._decode(1) + self._counted_context(context)


def prompt_tokens(text: str) -> int:
    return max(1, round(len(text) / CHARS_PER_TOKEN))


def _cached(prefix_chars: int) -> int:
    tokens = int(prefix_chars / CHARS_PER_TOKEN)
    return tokens - tokens % BLOCK_TOKENS


def _common(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def requests(conversations: Sequence[Conversation], concurrency: int, max_tokens: int) -> list[list[Request]]:
    """The workload's requests dealt to `concurrency` closed-loop clients in turn (each conversation's turns in
    order on one client), each prompt's length and prefix-cache hit from its text: the text of the system, the
    tools, and each turn (an earlier turn's answer counted at its max_tokens); a hit is the longest text it shares
    with a prompt an earlier request of its own client, or a request before the first round, sent, in whole
    blocks."""
    clients: list[list[Request]] = [[] for _ in range(concurrency)]
    seen: list[list[str]] = [[] for _ in range(concurrency)]
    shared: list[str] = []  # the prompts of requests finished before the clients' first round ends
    for index, conv in enumerate(conversations):
        client = index % concurrency
        head = json.dumps({"system": conv.system, "tools": conv.tools}) if conv.system or conv.tools else ""
        history = head
        for turn_index, turn in enumerate(conv.turns):
            answer_tokens = turn.max_tokens or max_tokens
            text = history + turn.user
            earlier = seen[client] + (shared if index >= concurrency else [])
            hit = max((_common(text, other) for other in earlier), default=0)
            tokens = prompt_tokens(text)
            clients[client].append(Request(tokens, answer_tokens, min(_cached(hit), tokens), conv.id, turn_index))
            seen[client].append(text)
            history = text + (turn.assistant or "x" * int(answer_tokens * CHARS_PER_TOKEN))
        if index < concurrency:
            shared.extend(seen[client])
    return clients


@dataclass
class Prediction:
    """One variant's predicted run of one workload at one concurrency."""

    concurrency: int
    metrics: dict[str, Any]
    timeline: Timeline

    def as_json(self, factor: float = 1.0) -> dict[str, Any]:
        """The metrics, each timed one with the range a calibration whose largest miss is `factor` supports (a
        time over `factor` to times it; a rate, the score, likewise)."""
        keys = ("requests", "ttft_p50_ms", "ttft_p90_ms", "output_tps_e2e_p10", "output_tps_e2e_p50",
                "output_tps_agg", "cache_hit_rate", "official_replay_score", "wall_time_s")
        ranged = ("ttft_p50_ms", "ttft_p90_ms", "output_tps_e2e_p10", "output_tps_e2e_p50", "output_tps_agg",
                  "official_replay_score", "wall_time_s")
        ranges = {k: [v / factor, v * factor] for k in ranged if isinstance(v := self.metrics.get(k), float | int)}
        return {"concurrency": self.concurrency, **{k: self.metrics.get(k) for k in keys},
                "ranges": ranges, "steps": len(self.timeline.steps)}


def predict(cost: StepCost, limits: Limits, clients: list[list[Request]]) -> Prediction:
    try:
        timeline = simulate(clients, limits, cost)
    except RuntimeError as exc:  # a budget that admits no prompt: vLLM would not serve it either
        raise ToolkitError(f"the scheduler cannot run this workload: {exc}") from None
    return Prediction(len(clients), summarize(timeline.records, timeline.wall_s), timeline)
