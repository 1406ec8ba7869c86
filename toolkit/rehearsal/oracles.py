"""The rehearsal's oracles: what the served path computes, compared with computations that do not share its defects.

Every answer is read on one channel every adapter keeps: `/v1/completions` with a token-id prompt, greedy, the
server started with `--return-tokens-as-token-ids`, so each token is its id (`token_id:N`), never its text. The
prompts are the served chat template's renderings, as the server's own `/tokenize` gives them.

- **TP 1** (`against`): the answers at TP N equal those of a TP 1 server on the same tree and checkpoint. A TP
  all-reduce that sums nothing, a shard loaded into the wrong rank, replicated KV heads read from the wrong head:
  each makes the ranks' answer differ from one rank's.
- **The plain forward** (`against`, toolkit/rehearsal/forward.py): the answers equal the checkpoint's greedy answers
  computed outside vLLM by code written from the model's math, which shares nothing with the served path: a fast
  path (the toolkit's or the adapter's) that is wrong everywhere, in prefill and decode and at every TP, is wrong on
  one side only here.
- **Prefill** (`against_prefill`): every decoded token equals the next token a prefill of the prompt and the
  tokens before it computes. One prefill of the prompt and the whole answer gives them all: its prompt logprobs
  (vLLM's `prompt_logprobs`, prefix cache off) at each answer token are what a prefill ending there computes, since
  a prompt pass is causal. The decode path (paged attention over the block table, the recurrent state carried step
  by step) against the prefill path (the chunked prompt pass).

Both servers compute in float32 (in bf16 how a step is batched changes its rounding); two answers that part where
both sides had the two tokens within `tie_nats` of each other took the two sides of a near-tie, which is reported,
not failed. A comparison that ends up with fewer than `minimum` tokens compared fails: an oracle that compared
nothing has not passed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

TOKEN_ID_PREFIX = "token_id:"


@dataclass(frozen=True)
class Prompt:
    name: str
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Answer:
    """One greedy answer as token ids, each with its logprob and the top alternatives (id -> logprob)."""

    prompt: Prompt
    ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    top: tuple[dict[int, float], ...] = ()
    error: str | None = None


@dataclass
class Comparison:
    """What one oracle found: answers or tokens that differ, near-ties it stepped over, and how many tokens it
    compared."""

    differ: list[str] = field(default_factory=list)
    ties: list[str] = field(default_factory=list)
    compared: int = 0

    def mismatch(self, name: str, index: int, tie: float | None, differs: str) -> None:
        """A token the two sides disagree on: a near-tie (`tie`: how far apart, in nats) is said and stepped over,
        anything else is `differs`."""
        if tie is None:
            self.differ.append(differs)
        else:
            self.ties.append(f"{name} at token {index} (logprobs {tie:.4f} apart)")

    def problems(self, minimum: int, what: str) -> list[str]:
        found = list(self.differ)
        if self.compared < minimum:
            found.append(f"only {self.compared} token(s) {what} compared, fewer than the {minimum} this check needs")
        return found


def token_id(token: str) -> int:
    """`token_id:N` (vLLM's --return-tokens-as-token-ids) as N; anything else is the server not naming ids."""
    if not token.startswith(TOKEN_ID_PREFIX):
        raise ValueError(f"a token came as {token!r}, not as its id: the server runs without "
                         "--return-tokens-as-token-ids")
    return int(token[len(TOKEN_ID_PREFIX):])


def parse_answer(prompt: Prompt, payload: dict[str, Any]) -> Answer:
    """A `/v1/completions` response (one choice, logprobs asked) as an Answer."""
    choice = (payload.get("choices") or [{}])[0]
    logprobs = choice.get("logprobs") or {}
    tokens = logprobs.get("tokens")
    if tokens is None:
        return Answer(prompt, error=f"the answer carries no logprobs.tokens: {str(payload)[:300]}")
    try:
        ids = tuple(token_id(t) for t in tokens)
        top = tuple({token_id(k): float(v) for k, v in (alternatives or {}).items()}
                    for alternatives in logprobs.get("top_logprobs") or [{}] * len(ids))
    except ValueError as exc:
        return Answer(prompt, error=str(exc))
    values = tuple(float(v) if v is not None else float("nan") for v in logprobs.get("token_logprobs") or ())
    return Answer(prompt, ids, values, top)


async def tokenize(http: httpx.AsyncClient, url: str, model: str, messages: list[dict[str, Any]]) -> list[int]:
    """The served chat template's rendering of `messages` (with the generation prompt) as the server's ids."""
    response = await http.post(url.rstrip("/") + "/tokenize", json={
        "model": model, "messages": messages, "add_generation_prompt": True, "add_special_tokens": False})
    response.raise_for_status()
    return [int(i) for i in response.json()["tokens"]]


async def _completion(http: httpx.AsyncClient, url: str, model: str, prompt: Prompt,
                      asked: dict[str, Any]) -> Answer | dict[str, Any]:
    """The `/v1/completions` response to a greedy token-id `prompt` (`asked`: the rest of the body), or an Answer
    carrying why there is none."""
    body = {"model": model, "prompt": list(prompt.ids), "temperature": 0, "ignore_eos": True, "stream": False,
            **asked}
    try:
        response = await http.post(url.rstrip("/") + "/v1/completions", json=body)
    except httpx.HTTPError as exc:
        return Answer(prompt, error=f"{type(exc).__name__}: {exc}")
    if response.status_code != 200:
        return Answer(prompt, error=f"HTTP {response.status_code}: {response.text[:300]}")
    payload: dict[str, Any] = response.json()
    return payload


async def complete(http: httpx.AsyncClient, url: str, model: str, prompt: Prompt, max_tokens: int,
                   top: int) -> Answer:
    """A greedy completion of a token-id prompt, every token with its id and logprob."""
    got = await _completion(http, url, model, prompt, {"max_tokens": max_tokens, "logprobs": top})
    return got if isinstance(got, Answer) else parse_answer(prompt, got)


def answers(url: str, model: str, prompts: Sequence[Prompt], max_tokens: int, top: int) -> list[Answer]:
    """Each prompt's answer, all sent at once (the server batches their steps, as it would its clients')."""
    async def run() -> list[Answer]:
        async with httpx.AsyncClient(timeout=600) as http:
            return list(await asyncio.gather(*(complete(http, url, model, p, max_tokens, top) for p in prompts)))
    return asyncio.run(run())


def prefill_prompt(answer: Answer) -> Prompt:
    """`answer`'s prompt and every token of it: one prefill whose prompt logprobs at each answer token are the next
    token a prefill of what came before that token computes."""
    return Prompt(f"{answer.prompt.name} and its {len(answer.ids)} token(s)", answer.prompt.ids + answer.ids)


def prefill_nexts(answer: Answer, prefilled: Answer | dict[str, Any]) -> list[Answer]:
    """Per token k of `answer`, the next token a prefill of its prompt and its first k tokens computes (the top
    ranked of the prompt logprobs at that token, with the top alternatives), read from the `/v1/completions`
    response to `prefill_prompt(answer)` asked with `prompt_logprobs`; `prefilled` an Answer carrying the request's
    error where it failed."""
    names = [f"{answer.prompt.name} + {k} token(s)" for k in range(len(answer.ids))]
    if isinstance(prefilled, Answer):
        return [Answer(Prompt(n, ()), error=prefilled.error) for n in names]
    entries = ((prefilled.get("choices") or [{}])[0].get("prompt_logprobs")) or []
    start = len(answer.prompt.ids)
    nexts = []
    for k, name in enumerate(names):
        entry = entries[start + k] if start + k < len(entries) else None
        if not entry:
            nexts.append(Answer(Prompt(name, ()), error=f"no prompt logprobs at token {start + k} of "
                                                        f"{len(entries)}: {str(prefilled)[:200]}"))
            continue
        ranked = sorted((int(v["rank"]), int(i), float(v["logprob"])) for i, v in entry.items())
        _, best, logprob = ranked[0]
        nexts.append(Answer(Prompt(name, ()), (best,), (logprob,), ({i: lp for _, i, lp in ranked},)))
    return nexts


async def prefill(http: httpx.AsyncClient, url: str, model: str, answer: Answer, top: int) -> Answer | dict[str, Any]:
    """The response to one prefill of `answer`'s prompt and tokens with their prompt logprobs, or an Answer
    carrying why there is none."""
    return await _completion(http, url, model, prefill_prompt(answer), {"max_tokens": 1, "prompt_logprobs": top})


def prefills(url: str, model: str, answers: Sequence[Answer], top: int) -> list[Answer | dict[str, Any]]:
    """One prefill per answer that has tokens, all sent at once; an answer without tokens gets its own error."""
    async def run() -> list[Answer | dict[str, Any]]:
        async with httpx.AsyncClient(timeout=600) as http:
            return list(await asyncio.gather(*(
                prefill(http, url, model, a, top) if a.ids else _failed(a) for a in answers)))
    return asyncio.run(run())


async def _failed(answer: Answer) -> Answer:
    return Answer(answer.prompt, error=answer.error or "no tokens")


def _gap(logprob: float, top: dict[int, float], other: int) -> float:
    return abs(logprob - top.get(other, float("-inf")))


def _tie(a_id: int, a_lp: float, a_top: dict[int, float], b_id: int, b_lp: float, b_top: dict[int, float],
         tie_nats: float) -> float | None:
    """How far apart the two tokens were, when both sides had the other's within `tie_nats` of their own."""
    gap = max(_gap(a_lp, a_top, b_id), _gap(b_lp, b_top, a_id))
    return gap if gap <= tie_nats else None


def _logprob(answer: Answer, index: int, token: int) -> str:
    """What `answer` gave `token` at `index`: its own token's logprob, or an alternative's, or below its top."""
    if answer.ids[index] == token:
        return f"{answer.logprobs[index]:.4f}"
    found = answer.top[index].get(token)
    return f"{found:.4f}" if found is not None else f"below its top {len(answer.top[index])}"


def against(mine: Sequence[Answer], theirs: Sequence[Answer], tie_nats: float, mine_as: str,
            theirs_as: str) -> Comparison:
    """Each answer against another computation's of the same prompt (`mine_as`, `theirs_as`: how the report names
    the two, "at TP 2", "at TP 1"), token by token, up to where they part at a near-tie (the tokens after it continue
    another prefix); where they part otherwise, the two tokens and what each side gave both."""
    out = Comparison()
    for a, b in zip(mine, theirs, strict=True):
        name = a.prompt.name
        if a.error or b.error:
            out.differ.append(f"{name}: a request failed ({a.error or b.error})")
            continue
        j = next((i for i, (x, y) in enumerate(zip(a.ids, b.ids, strict=False)) if x != y), None)
        if j is None:
            if len(a.ids) != len(b.ids):
                out.differ.append(f"{name}: {len(a.ids)} tokens {mine_as}, {len(b.ids)} {theirs_as}")
            out.compared += min(len(a.ids), len(b.ids))
            continue
        out.compared += j
        x, y = a.ids[j], b.ids[j]
        out.mismatch(name, j, _tie(x, a.logprobs[j], a.top[j], y, b.logprobs[j], b.top[j], tie_nats),
                     f"{name}: token {j} is {x} {mine_as}, {y} {theirs_as} (logprobs of {x} and {y}: "
                     f"{_logprob(a, j, x)} and {_logprob(a, j, y)} {mine_as}, {_logprob(b, j, x)} and "
                     f"{_logprob(b, j, y)} {theirs_as}; ids {list(a.ids)} vs {list(b.ids)})")
    return out


def against_prefill(answer: Answer, nexts: Sequence[Answer], tie_nats: float) -> Comparison:
    """Each decoded token of `answer` against the one token a fresh prefill of what came before it computes; the
    first token (itself computed by the prompt's prefill) is not a decode and is not counted."""
    out = Comparison()
    name = answer.prompt.name
    if answer.error:
        out.differ.append(f"{name}: the answer failed ({answer.error})")
        return out
    for k, (token, lp, top, nxt) in enumerate(zip(answer.ids, answer.logprobs, answer.top, nexts, strict=True)):
        if nxt.error or not nxt.ids:
            out.differ.append(f"{name}: the prefill of its first {k} token(s) failed ({nxt.error or 'no token'})")
            continue
        if k == 0:
            continue
        if nxt.ids[0] == token:
            out.compared += 1
            continue
        out.mismatch(name, k, _tie(token, lp, top, nxt.ids[0], nxt.logprobs[0], nxt.top[0], tie_nats),
                     f"{name}: decoded token {k} is {token}, a prefill of the {k} before it gives {nxt.ids[0]}")
    return out
