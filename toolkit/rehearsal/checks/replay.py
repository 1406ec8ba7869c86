"""The platform replay's request shapes that servers on this image failed (shared/platform-replay: the failure
classes of its logs), each sent to the served server as the replay sends it, and the server still answering after
them: a completion limit beyond the context, an assistant turn echoing a streamed tool call's `index`, and the
short request once every other check is done (a request that ends the engine fails every request after it)."""

from __future__ import annotations

from typing import Any, ClassVar

import httpx

from toolkit.bench import client, workloads
from toolkit.rehearsal.checks.base import RehearsalCheck
from toolkit.rehearsal.model import MAX_TOKENS, Check
from toolkit.rehearsal.requests import answered, send
from toolkit.rehearsal.servers import Live

# a completion limit far beyond what the prompt leaves, as the replay's 4,096 to 65,536 against its long prompts
BEYOND = 4096
# the answer the limit is cut to: this many tokens of room are left by the prompt
ROOM = 4
REPLAY_TIMEOUT_S = 600.0


def _tokenized(live: Live, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The served template's rendering of `messages` with the generation prompt, as the server counts it (`count`)
    against its context (`max_model_len`)."""
    response = httpx.post(live.server.url + "/tokenize", json={
        "model": live.server.model, "messages": messages, "add_generation_prompt": True,
        "add_special_tokens": False}, timeout=REPLAY_TIMEOUT_S)
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


def _tokens(live: Live, messages: list[dict[str, Any]]) -> int:
    return int(_tokenized(live, messages)["count"])


def _chat(live: Live, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(live.server.url + "/v1/chat/completions", json={"model": live.server.model, **body},
                      timeout=REPLAY_TIMEOUT_S)


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json().get("message", response.text))[:400]
    except ValueError:
        return response.text[:400]


def _filled(live: Live, tokens: int) -> tuple[list[dict[str, Any]], int]:
    """A user message whose rendering is `tokens` long, or as near as the tokenizer allows below it: counted by
    the server, grown word by word."""
    word = " rehearse"
    messages = [{"role": "user", "content": word.strip()}]
    count = _tokens(live, messages)
    per_word = max(1, _tokens(live, [{"role": "user", "content": (word * 9).strip()}]) - count) / 8
    for _ in range(4):  # the rendering is near-linear in the words: a few corrections land on it
        words = max(1, int(len(messages[0]["content"].split()) + (tokens - count) / per_word))
        messages = [{"role": "user", "content": (word * words).strip()}]
        count = _tokens(live, messages)
        if tokens - 2 <= count <= tokens:
            break
    return messages, count


class _Shape(RehearsalCheck):
    """A replay shape sent to the served server: a request the server does not answer at all (its engine died, it
    exited) fails the check with the server's own error, located."""

    servers = ("served",)

    def on(self, server: str, live: Live) -> None:
        try:
            self.send(live)
        except httpx.HTTPError as exc:
            self.result = Check(self.name, False, f"the served server did not answer ({type(exc).__name__}: {exc}); "
                                f"its log: {self.run.stage.server_error(live.server)}")

    def send(self, live: Live) -> None:
        raise NotImplementedError


class CompletionLimit(_Shape):
    """A prompt that fits the context with a completion limit that does not: answered with the limit cut to the
    room left (finish_reason "length"), not refused; a prompt that alone fills the context is refused with vLLM's
    own 400."""

    name = "completion-limit"
    summary = "the replay's failure class `context`: a completion limit beyond the context, a prompt beyond it"

    def send(self, live: Live) -> None:
        stage = self.run.stage
        context = int(_tokenized(live, [{"role": "user", "content": "hi"}])["max_model_len"])
        messages, prompt = _filled(live, context - ROOM)
        found: list[str] = []
        # the platform's refusals name the limit as vLLM 0.6.3 reads max_tokens; current clients send
        # max_completion_tokens: each alone
        for limit in ("max_tokens", "max_completion_tokens"):
            response = _chat(live, {"messages": messages, limit: BEYOND, "temperature": 0, "ignore_eos": True})
            if response.status_code != 200:
                found.append(f"a {prompt}-token prompt with {limit} {BEYOND} at a {context}-token context was "
                             f"answered HTTP {response.status_code}: {_message(response)}")
                continue
            data = response.json()
            got, reason = data["usage"]["completion_tokens"], data["choices"][0]["finish_reason"]
            if got != context - prompt or reason != "length":
                found.append(f"a {prompt}-token prompt with {limit} {BEYOND} at a {context}-token context answered "
                             f"{got} tokens ending {reason!r}, not the {context - prompt} left ending 'length'")
        over, counted = _filled(live, context + 8)
        refused = _chat(live, {"messages": over, "max_tokens": MAX_TOKENS, "temperature": 0})
        said = _message(refused)
        if counted <= context or refused.status_code != 400 or "maximum context length" not in said:
            found.append(f"a {counted}-token prompt at a {context}-token context was answered HTTP "
                         f"{refused.status_code} ({said[:200]}), not vLLM's 400 naming the context")
        stage.rehearsal.requests.append({"sent": self.name, "ok": not found, "prompt_tokens": prompt,
                                         "completion_limit": BEYOND})
        self.result = Check(self.name, not found, "; ".join(found) or (
            f"a {prompt}-token prompt with max_tokens, then max_completion_tokens {BEYOND} at the rehearsed "
            f"{context}-token context answered its {context - prompt} tokens of room, ending 'length'; a "
            f"{counted}-token prompt refused with vLLM's 400 (the replay's class `context`)"))


class ToolCallIndex(_Shape):
    """An assistant turn whose tool call carries the `index` a streamed delta had (clients echo it back), then the
    tool's answer: accepted and answered."""

    name = "tool-call-index"
    summary = "the replay's failure class `tool-call-index`: an assistant tool call echoing its streamed `index`"
    concurrent = True

    def not_applicable(self) -> str | None:
        if self.run.tool_parser is None:
            return "the run config serves no tool calls (no --enable-auto-tool-choice with a --tool-call-parser)"
        return None

    def send(self, live: Live) -> None:
        tool = workloads.tool_schemas()[0]
        name = tool["function"]["name"]
        messages = [{"role": "user", "content": "Use the tool once."},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"index": 0, "id": "call_0", "type": "function",
                         "function": {"name": name, "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "call_0", "content": "done"}]
        response = _chat(live, {"messages": messages, "tools": [tool], "max_tokens": MAX_TOKENS, "temperature": 0,
                                "ignore_eos": True})
        ok = response.status_code == 200
        self.run.stage.rehearsal.requests.append({"sent": self.name, "status": response.status_code, "ok": ok})
        self.result = Check(self.name, ok, (
            f"an assistant tool call carrying `index` and the tool's answer were answered ({MAX_TOKENS} tokens; "
            "the replay's class `tool-call-index`)") if ok else (
            f"HTTP {response.status_code}: {_message(response)} (the replay's class "
            "`tool-call-index`: 6 of submission 694's requests)"))


class StillServing(RehearsalCheck):
    """The short request once more, after every other check's requests on the served server: a request that ended
    the engine fails every request after it on the platform."""

    name = "still-serving"
    summary = "the short request answered again after every other check (the replay's engine-ending class)"
    servers = ("served",)
    last: ClassVar[bool] = True

    def on(self, server: str, live: Live) -> None:
        [record] = send(self.run.stage, live.server, [client.Conversation(
            self.name, [client.Turn("Say hello in one word.")])], 1, self.name)
        again = answered(self.name, record, self.run.reasoning)
        self.result = Check(self.name, again.ok, (
            f"the short request answered again after every other check's requests on the served server "
            f"({again.detail})") if again.ok else f"after the other checks' requests: {again.detail}")
