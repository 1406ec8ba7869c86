"""answers: the oracles (toolkit/rehearsal/oracles.py) on the served token ids: the answers at TP N against TP 1's,
and every decoded token against a fresh prefill's next token."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from toolkit.rehearsal.checks.base import RehearsalCheck, Run
from toolkit.rehearsal.checks.prefix_cache import conversations
from toolkit.rehearsal.model import COMPARED_DTYPE, TIE_NATS, TOP_LOGPROBS, Check
from toolkit.rehearsal.oracles import (
    Answer,
    Comparison,
    Prompt,
    against_prefill,
    against_tp1,
    answers,
    prefill_prompts,
    tokenize,
)
from toolkit.rehearsal.requests import multi_system_messages
from toolkit.rehearsal.servers import Live, Stage

# each answer's length: its decoded tokens are compared one by one with a fresh prefill's
ANSWER_TOKENS = 12
# an oracle that ends up comparing fewer tokens than this (near-ties early in every answer, failed requests) fails
MIN_COMPARED = 16


def answer_messages() -> list[tuple[str, list[dict[str, Any]]]]:
    """What the answers are asked: the conversations' first turns (longer than the batch-token budget: a chunked
    prefill) and the multi-system request (one chunk)."""
    firsts = [(c.id, [{"role": "system", "content": c.system or ""}, {"role": "user", "content": c.turns[0].user}])
              for c in conversations()]
    return [*firsts, ("multi-system", multi_system_messages())]


def _answer(stage: Stage, live: Live, label: str, prompts: list[Prompt],
            max_tokens: int) -> list[Answer]:
    """The prompts' greedy answers on `live`, kept in the report's requests; a 5xx carries the server's error."""
    got = answers(live.server.url, live.server.model, prompts, max_tokens, TOP_LOGPROBS)
    if any(a.error and a.error.startswith("HTTP 5") for a in got):
        cause = stage.server_error(live.server)
        got = [Answer(a.prompt, error=f"{a.error}; the server's log: {cause}") if a.error else a for a in got]
    stage.rehearsal.requests.extend({"sent": label, "conversation": a.prompt.name, "prompt_tokens": len(a.prompt.ids),
                                     "ok": a.error is None, "message": a.error, "token_ids": list(a.ids)} for a in got)
    return got


def _tokenized(live: Live) -> list[Prompt]:
    async def run() -> list[Prompt]:
        async with httpx.AsyncClient(timeout=120) as http:
            return [Prompt(name, tuple(await tokenize(http, live.server.url, live.server.model,
                                                                      messages)))
                    for name, messages in answer_messages()]
    return asyncio.run(run())


def answers_check(tp: int, mine: list[Answer], nexts: list[list[Answer]],
                  theirs: list[Answer] | None) -> Check:
    """The oracles' verdict: TP N against TP 1 (when TP N > 1), every decoded token against a fresh prefill."""
    problems: list[str] = []
    noted: list[str] = []
    said: list[str] = []
    failed = [f"{a.prompt.name}: {a.error}" for a in mine if a.error]
    if failed:
        return Check("answers", False, "the answers could not be read: " + "; ".join(failed))
    if theirs is not None:
        tp1 = against_tp1(mine, theirs, TIE_NATS, tp)
        if found := tp1.problems(MIN_COMPARED, f"of TP {tp} against TP 1"):
            problems.append(f"TP {tp} differs from TP 1: {'; '.join(found)}")
        if tp1.ties:
            noted.append(f"TP {tp} parted from TP 1 only at a near-tie: {', '.join(tp1.ties)}")
        said.append(f"{tp1.compared} tokens of {len(mine)} answers at TP {tp} equal TP 1's")
    else:
        said.append("TP 1 is the rehearsed size: no answer of another rank count to compare with")
    prefill = Comparison()
    for answer, following in zip(mine, nexts, strict=True):
        one = against_prefill(answer, following, TIE_NATS)
        prefill.differ += one.differ
        prefill.ties += one.ties
        prefill.compared += one.compared
    if found := prefill.problems(MIN_COMPARED, "decoded"):
        problems.append(f"decode differs from prefill: {'; '.join(found)}")
    if prefill.ties:
        noted.append(f"decoded tokens parted from a prefill's only at a near-tie: {', '.join(prefill.ties)}")
    said.append(f"{prefill.compared} decoded tokens each equal the next token of a fresh prefill of what came before "
                "it")
    lengths = [len(a.prompt.ids) for a in mine]
    shown = (f"{'; '.join(said)} (prompts of {min(lengths)}-{max(lengths)} tokens, {ANSWER_TOKENS} greedy tokens each, "
             f"{COMPARED_DTYPE}, prefix cache off, by token id)")
    extra = f" ({'; '.join(noted)})" if noted else ""
    return Check("answers", not problems, "; ".join(problems) + extra if problems else shown + extra)


class Answers(RehearsalCheck):
    name = "answers"
    summary = "the oracles: TP N = TP 1, each decoded token = a fresh prefill's next"
    servers = ("cache-off",)

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.prompts: list[Prompt] = []
        self.mine: list[Answer] = []
        self.nexts: list[list[Answer]] = []
        self.theirs: list[Answer] | None = None

    def needs(self) -> tuple[str, ...]:
        # the TP 1 reference only where there is another rank count, and only for answers that were read (a failure
        # is reported as it is, not hidden behind another start)
        if self.run.stage.tp > 1 and not any(a.error for a in self.mine):
            return (*self.servers, "tp1")
        return self.servers

    def on(self, server: str, live: Live) -> None:
        stage, tp = self.run.stage, self.run.stage.tp
        if server == "tp1":
            self.theirs = _answer(stage, live, "answers, TP 1", self.prompts, ANSWER_TOKENS)
            return
        self.prompts = _tokenized(live)
        self.mine = _answer(stage, live, f"answers, TP {tp}", self.prompts, ANSWER_TOKENS)
        following = [prefill_prompts(a) for a in self.mine]
        flat = _answer(stage, live, f"answers, TP {tp}: one token after a fresh prefill",
                       [p for group in following for p in group], 1)
        self.nexts, at = [], 0
        for group in following:
            self.nexts.append(flat[at:at + len(group)])
            at += len(group)

    def verdict(self) -> Check:
        if not self.mine:
            return self.unsent()
        return answers_check(self.run.stage.tp, self.mine, self.nexts, self.theirs)
