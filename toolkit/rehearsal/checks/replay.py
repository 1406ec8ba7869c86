"""The platform replay's request shapes that servers on this image failed (shared/platform-replay: the failure
classes of its logs), each sent to the served server as the replay sends it, and the server still answering after
them: a completion limit beyond the context, an assistant turn echoing a streamed tool call's `index`, a three-turn
thread with tools whose later turns hit the prefix cache, a prompt with several images, an image whose tokens cross a
prefill chunk's end, and the short request once every other check is done (a request that ends the engine fails
every request after it)."""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any, ClassVar

import httpx

from toolkit.bench import client, experiment, workloads
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


NO_TOOLS = "the run config serves no tool calls (no --enable-auto-tool-choice with a --tool-call-parser)"


def _echoed_call(name: str, call_id: str) -> dict[str, Any]:
    """An assistant turn whose tool call carries the `index` its streamed delta had, as clients echo it back."""
    return {"role": "assistant", "content": None, "tool_calls": [
        {"index": 0, "id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}]}


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

    def said(self, response: httpx.Response, live: Live) -> str:
        """What the server answered a failed request; for a 5xx, with its own error from its log, located."""
        told = f"HTTP {response.status_code}: {_message(response)}"
        if response.status_code >= 500:
            told += f"; the server's log: {self.run.stage.server_error(live.server)}"
        return told


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
                             f"answered {self.said(response, live)}")
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
            return NO_TOOLS
        return None

    def send(self, live: Live) -> None:
        tool = workloads.tool_schemas()[0]
        name = tool["function"]["name"]
        messages = [{"role": "user", "content": "Use the tool once."}, _echoed_call(name, "call_0"),
                    {"role": "tool", "tool_call_id": "call_0", "content": "done"}]
        response = _chat(live, {"messages": messages, "tools": [tool], "max_tokens": MAX_TOKENS, "temperature": 0,
                                "ignore_eos": True})
        ok = response.status_code == 200
        self.run.stage.rehearsal.requests.append({"sent": self.name, "status": response.status_code, "ok": ok})
        self.result = Check(self.name, ok, (
            f"an assistant tool call carrying `index` and the tool's answer were answered ({MAX_TOKENS} tokens; "
            "the replay's class `tool-call-index`)") if ok else (
            f"{self.said(response, live)} (the replay's class `tool-call-index`: 6 of submission 694's requests)"))


class ToolThread(_Shape):
    """A three-turn agent thread as the replay's (690 of its 881 requests carry tools, in about 768 threads of a
    median three requests): the system prompt and every tool schema, then each turn the assistant's tool call (with
    the `index` its stream had), the tool's answer and the next user message; each later turn must be answered and
    find the earlier turns in the prefix cache (58% of the replay's prompt tokens came from it)."""

    name = "tool-thread"
    summary = "a three-turn thread with every tool schema, tool calls and results; later turns hit the prefix cache"

    def not_applicable(self) -> str | None:
        if self.run.tool_parser is None:
            return NO_TOOLS
        if not self.run.caching:
            return "the run config serves without --enable-prefix-caching: no turn can hit the cache"
        return None

    def send(self, live: Live) -> None:
        tools = workloads.tool_schemas()
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent with tools."},
                                          {"role": "user", "content": "Look into the weather, step by step."}]
        found: list[str] = []
        turns: list[str] = []
        previous = 0  # the prompt tokens the turn before sent
        for turn in range(3):
            response = _chat(live, {"messages": messages, "tools": tools, "tool_choice": "auto",
                                    "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
            if response.status_code != 200:
                found.append(f"turn {turn + 1}: {self.said(response, live)}")
                break
            usage = response.json()["usage"]
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            turns.append(f"{usage['prompt_tokens']} ({cached} cached)")
            if turn and cached * 2 < previous:
                found.append(f"turn {turn + 1} found {cached} of its {usage['prompt_tokens']} prompt tokens in the "
                             f"cache, less than half of the {previous} the turn before sent")
            previous = int(usage["prompt_tokens"])
            name = tools[turn]["function"]["name"]
            messages += [_echoed_call(name, f"call_{turn}"),
                         {"role": "tool", "tool_call_id": f"call_{turn}", "content": f"result {turn}: sunny"},
                         {"role": "user", "content": f"Turn {turn + 2}: go on."}]
        self.run.stage.rehearsal.requests.append({"sent": self.name, "ok": not found, "turns": turns})
        self.result = Check(self.name, not found, "; ".join(found) or (
            f"three turns with {len(tools)} tool schemas, tool calls and results answered; prompt tokens "
            f"{', '.join(turns)}: each later turn found the earlier ones in the prefix cache"))


def png(width: int, height: int, shade: int) -> str:
    """A `data:` URL of an RGB PNG (a gradient, `shade` apart between images), written with the standard library."""
    rows = b"".join(b"\x00" + bytes(((x + shade) % 256, (y * 2) % 256, (x + y + shade) % 256)[c]
                                     for x in range(width) for c in range(3)) for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _image(shade: int) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": png(256, 256, shade)}}


class _Images(_Shape):
    def not_applicable(self) -> str | None:
        if not self.run.stage.multimodal():
            return "the tree's vLLM serves the checkpoint as a text model: no image reaches it"
        return None

    def served(self, live: Live, content: list[dict[str, Any]], said: str, failure: str) -> None:
        response = _chat(live, {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
                                "temperature": 0, "ignore_eos": True})
        ok = response.status_code == 200 and response.json()["usage"]["completion_tokens"] == MAX_TOKENS
        self.run.stage.rehearsal.requests.append({"sent": self.name, "status": response.status_code, "ok": ok})
        self.result = Check(self.name, ok, said if ok else f"{self.said(response, live)} ({failure})")


class SeveralImages(_Images):
    """A user turn with two images, as 13 of submission 694's requests had more than one."""

    name = "several-images"
    summary = "the replay's failure class `several-images`: two images in one prompt"

    def send(self, live: Live) -> None:
        self.served(live, [{"type": "text", "text": "Compare the two images."}, _image(0), _image(97)],
                      f"two images in one prompt answered ({MAX_TOKENS} tokens; the replay's class `several-images`)",
                      "the replay's class `several-images`: 13 of submission 694's requests; the run config's "
                      "--limit-mm-per-prompt lets a prompt carry as many")


class ImageChunks(_Images):
    """An image after a text as long as a prefill chunk, so its tokens cross the chunk's end (a multimodal
    rotary-position error on a chunked prefill ended another team's engine)."""

    name = "image-chunks"
    summary = "an image whose tokens cross a prefill chunk's end (another team's engine-ending error)"

    def send(self, live: Live) -> None:
        budget = int(experiment.flag_value(live.argv, "--max-num-batched-tokens") or 0)
        filled, count = _filled(live, budget - 24)  # the image's 64 tokens start 24 before the chunk ends
        self.served(live, [{"type": "text", "text": filled[0]["content"]}, _image(41),
                             {"type": "text", "text": "What is in the image?"}],
                      f"an image after a {count}-token text answered: its tokens crossed the {budget}-token "
                      f"chunk's end ({MAX_TOKENS} tokens; another team's engine-ending class)",
                      f"an image whose tokens cross the {budget}-token chunk's end")


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
