"""answers: the oracles (toolkit/rehearsal/oracles.py) on the served token ids: the answers at TP N against TP 1's,
against those of the recipe's fast paths off (the adapter's own code, TP 1), against the plain forward's
(toolkit/rehearsal/forward.py: outside vLLM, none of the recipe's code), and every decoded token against a fresh
prefill's next token."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import httpx

from toolkit.errors import ToolkitError
from toolkit.recipe import Recipe
from toolkit.rehearsal.checks.base import RehearsalCheck, Run
from toolkit.rehearsal.checks.prefix_cache import conversations
from toolkit.rehearsal.model import COMPARED_DTYPE, TIE_NATS, TOP_LOGPROBS, Check
from toolkit.rehearsal.oracles import (
    Answer,
    Comparison,
    Prompt,
    against,
    against_prefill,
    answers,
    prefill_nexts,
    prefills,
    tokenize,
)
from toolkit.rehearsal.requests import multi_system_messages
from toolkit.rehearsal.servers import Live, Stage
from toolkit.transforms.dispatch import Dispatch
from toolkit.variants import find as find_variant

PLAIN = "in the plain forward"
PATHS_OFF = "with the fast paths off"


@dataclass(frozen=True)
class FastPathsOff:
    """The env that turns the recipe's fast paths off (over the served run config's), how it was made, and what it
    leaves as served: fast paths it does not switch, code the recipe replaces with no switch, and the fixes."""

    env: dict[str, str]
    made: str
    not_covered: tuple[str, ...]
    fixes: tuple[str, ...]  # the dispatches that are fixes the image needs (`fix: true`), kept on


def fast_paths_off(recipe: Recipe) -> FastPathsOff:
    """The recipe's `checks.fast_paths_off` variant's env, or every fast-path dispatch switch the recipe adds and
    every prebuilt kernel's switch set to 0 (a dispatch that is a fix stays on)."""
    dispatches = [t for t in recipe.transforms if isinstance(t, Dispatch)]
    switches = [t.switch for t in dispatches if not t.fix] + [m.switch for t in recipe.kernels() for m in t.modules]
    fixes = tuple(t.switch for t in dispatches if t.fix)
    name = recipe.checks.fast_paths_off
    if name:
        variant = find_variant(recipe, name)  # env values only: the recipe's load refuses anything else
        env = {key: str(value) for key, value in variant.env.items()}
        made = f"the variant {name} ({variant.describe()})"
    elif switches:
        env = {switch: "0" for switch in switches}
        made = ("every fast-path dispatch and prebuilt kernel switch the recipe adds set to 0 (the recipe names no "
                "checks.fast_paths_off variant): " + " ".join(f"{s}=0" for s in switches))
    else:
        env = {}
        made = ("every dispatch the recipe adds is a fix the image needs" if dispatches else
                "the recipe adds no dispatch")
    left = [f"{s} (a fast path left as served)" for s in switches if s not in env]
    replaced = [f"{t.id} (replace-body: no switch)" for t in recipe.transforms if t.kind == "replace-body"]
    kept = tuple(s for s in fixes if env.get(s) != "0")  # a variant may turn a fix off too: then it is not kept on
    return FastPathsOff(env, made, tuple(left + replaced), kept)

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


Got = TypeVar("Got")


def _caused(stage: Stage, live: Live, got: list[Got]) -> list[Got]:
    """`got` with every failed request (an Answer carrying an error) told the server's own error from its log, read
    once, where any of them was a 5xx."""
    def failed(item: object) -> bool:
        return isinstance(item, Answer) and item.error is not None

    if not any(failed(g) and str(cast(Answer, g).error).startswith("HTTP 5") for g in got):
        return got
    cause = stage.server_error(live.server)
    return [cast(Got, Answer(cast(Answer, g).prompt, error=f"{cast(Answer, g).error}; the server's log: {cause}"))
            if failed(g) else g for g in got]


def _answer(stage: Stage, live: Live, label: str, prompts: list[Prompt],
            max_tokens: int) -> list[Answer]:
    """The prompts' greedy answers on `live`, kept in the report's requests; a 5xx carries the server's error."""
    got = _caused(stage, live, answers(live.server.url, live.server.model, prompts, max_tokens, TOP_LOGPROBS))
    stage.rehearsal.requests.extend({"sent": label, "conversation": a.prompt.name, "prompt_tokens": len(a.prompt.ids),
                                     "ok": a.error is None, "message": a.error, "token_ids": list(a.ids)} for a in got)
    return got


def _prefilled(stage: Stage, live: Live, label: str, mine: list[Answer]) -> list[list[Answer]]:
    """Per answer, per token: the next token a prefill of what came before it computes (one prefill of each answer
    with its prompt logprobs), kept in the report's requests; a 5xx carries the server's error."""
    got = _caused(stage, live, prefills(live.server.url, live.server.model, mine, TOP_LOGPROBS))
    nexts = [prefill_nexts(a, g) for a, g in zip(mine, got, strict=True)]
    stage.rehearsal.requests.extend(
        {"sent": label, "conversation": a.prompt.name, "prompt_tokens": len(a.prompt.ids) + len(a.ids),
         "ok": not isinstance(g, Answer), "message": g.error if isinstance(g, Answer) else None,
         "token_ids": [n.ids[0] if n.ids else None for n in following]}
        for a, g, following in zip(mine, got, nexts, strict=True))
    return nexts


def _tokenized(stage: Stage, live: Live) -> list[Prompt]:
    """The answers' prompts as the served template renders them; a server that fails to render them (or dies) is a
    ToolkitError carrying its log's cause, so the check fails saying why instead of the rehearsal crashing."""
    async def run() -> list[Prompt]:
        async with httpx.AsyncClient(timeout=120) as http:
            return [Prompt(name, tuple(await tokenize(http, live.server.url, live.server.model, messages)))
                    for name, messages in answer_messages()]
    try:
        return asyncio.run(run())
    except httpx.HTTPError as exc:
        raise ToolkitError(f"the server did not tokenize the answers' prompts ({type(exc).__name__}: {exc}); "
                           f"the server's log: {stage.server_error(live.server)}") from exc


def plain_answers(stage: Stage, prompts: list[Prompt]) -> tuple[list[Answer] | None, str]:
    """The plain forward's answers to `prompts` on the served checkpoint, or None and why it cannot read it."""
    from toolkit.rehearsal.forward import reference_answers

    if not (stage.model / "model.safetensors").is_file():
        return None, (f"the plain forward reads one model.safetensors, which {stage.model} does not have: the answers "
                      "are not compared outside vLLM")
    try:
        return reference_answers(stage.python, stage.model, prompts, ANSWER_TOKENS, TOP_LOGPROBS), ""
    except ToolkitError as exc:  # a checkpoint it cannot compute is one oracle fewer, said; the others still judge
        return None, f"{exc.message.splitlines()[0]}: the answers are not compared outside vLLM"


def answers_check(tp: int, mine: list[Answer], nexts: list[list[Answer]], theirs: list[Answer] | None,
                  plain: list[Answer] | None, unplain: str = "", off: list[Answer] | None = None,
                  reference: FastPathsOff | None = None) -> Check:
    """The oracles' verdict: TP N against TP 1 (when TP N > 1), against the fast paths off (`off`, made as
    `reference` says), against the plain forward (where it reads the checkpoint; `unplain` says why not), every
    decoded token against a fresh prefill."""
    problems: list[str] = []
    noted: list[str] = []
    said: list[str] = []
    failed = [f"{a.prompt.name}: {a.error}" for a in mine if a.error]
    if failed:
        return Check("answers", False, "the answers could not be read: " + "; ".join(failed))
    def oracle(theirs: list[Answer], theirs_as: str, what: str, differs: str, equal: str) -> None:
        """One reference's verdict: the answers against `theirs`, read into problems, near-ties and what held."""
        found = against(mine, theirs, TIE_NATS, f"at TP {tp}", theirs_as)
        if shown := found.problems(MIN_COMPARED, f"of TP {tp} against {what}"):
            problems.append(f"{differs}: {'; '.join(shown)}")
        if found.ties:
            noted.append(f"TP {tp} parted from {what} only at a near-tie: {', '.join(found.ties)}")
        said.append(f"{found.compared} tokens of {len(mine)} answers {equal}")

    if theirs is not None:
        oracle(theirs, "at TP 1", "TP 1", f"TP {tp} differs from TP 1", f"at TP {tp} equal TP 1's")
    else:
        said.append("TP 1 is the rehearsed size: no answer of another rank count to compare with")
    if off is not None and reference is not None:
        oracle(off, PATHS_OFF, "the fast paths off", f"TP {tp} differs from the recipe's fast paths off "
               f"({reference.made})", f"equal those with the fast paths off (TP 1, {reference.made})")
        if reference.not_covered:
            noted.append("not covered by the fast-paths-off reference: " + ", ".join(reference.not_covered))
        if reference.fixes:
            noted.append("kept on there, fixes the image needs: " + ", ".join(reference.fixes))
    elif reference is not None and not reference.env:
        noted.append(f"no fast path to turn off ({reference.made}): the fast-paths-off reference would be the served "
                     "code itself, not run")
    if plain is not None:
        oracle(plain, PLAIN, "the plain forward", f"TP {tp} differs from the plain forward (outside vLLM: a path the "
               "recipe serves computes another model)",
               "equal the plain forward's (outside vLLM, from the model's math)")
    elif unplain:
        noted.append(unplain)
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
    summary = ("the oracles: TP N = TP 1 = the fast paths off = the plain forward outside vLLM, each decoded token = "
               "a fresh prefill's next")
    servers = ("cache-off",)

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.prompts: list[Prompt] = []
        self.mine: list[Answer] = []
        self.nexts: list[list[Answer]] = []
        self.theirs: list[Answer] | None = None
        self.plain: list[Answer] | None = None
        self.unplain = ""
        self.off: list[Answer] | None = None
        self.untokenized = ""  # why the prompts could not be rendered on the served server, if they could not
        self.reference = fast_paths_off(run.stage.recipe)  # refused before anything starts when it cannot be made

    def needs(self) -> tuple[str, ...]:
        # the TP 1 reference only where there is another rank count, and only for answers that were read (a failure
        # is reported as it is, not hidden behind another start)
        if self.untokenized or any(a.error for a in self.mine):
            return self.servers
        paths_off = ("paths-off",) if self.reference.env else ()  # no fast path to turn off: the served code
        return (*self.servers, *(("tp1",) if self.run.stage.tp > 1 else ()), *paths_off)

    def env(self, server: str) -> dict[str, tuple[str, str]]:
        if server != "paths-off":
            return {}
        return {key: (value, f"the answers' reference with the fast paths off: {self.reference.made}")
                for key, value in self.reference.env.items()}

    def on(self, server: str, live: Live) -> None:
        stage, tp = self.run.stage, self.run.stage.tp
        if server == "tp1":
            self.theirs = _answer(stage, live, "answers, TP 1", self.prompts, ANSWER_TOKENS)
            return
        if server == "paths-off":
            self.off = _answer(stage, live, "answers, the fast paths off, TP 1", self.prompts, ANSWER_TOKENS)
            return
        try:
            self.prompts = _tokenized(stage, live)
        except ToolkitError as exc:
            self.untokenized = exc.message
            return
        self.mine = _answer(stage, live, f"answers, TP {tp}", self.prompts, ANSWER_TOKENS)
        self.nexts = _prefilled(stage, live, f"answers, TP {tp}: a prefill of each answer, its prompt logprobs",
                                self.mine)
        if not any(a.error for a in self.mine):
            self.plain, self.unplain = plain_answers(stage, self.prompts)

    def verdict(self) -> Check:
        if self.untokenized:
            return Check(self.name, False, self.untokenized)
        if not self.mine:
            return self.unsent()
        return answers_check(self.run.stage.tp, self.mine, self.nexts, self.theirs, self.plain, self.unplain,
                             self.off, self.reference)
