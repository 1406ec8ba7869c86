"""The streaming client: closed-loop workers, one conversation's turns in order on one worker, every SSE line
timestamped as it arrives, token counts from `usage` only."""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

from toolkit.bench.metrics import RequestRecord
from toolkit.bench.sse import Parser, content_of, join_tool_calls, logprobs_of, reasoning_of


@dataclass
class Turn:
    user: str
    assistant: str | None = None  # a recorded reply to feed back (None: the live reply)
    max_tokens: int | None = None


@dataclass
class Conversation:
    id: str
    turns: list[Turn] = field(default_factory=list)
    system: str | None = None
    tools: list[dict[str, Any]] | None = None
    body: dict[str, Any] | None = None  # a replayed request body, sent as it is (model and streaming forced)


@dataclass(frozen=True)
class Settings:
    url: str  # the server's base URL
    model: str = "llm"
    max_tokens: int = 128
    ignore_eos: bool = False
    timeout_s: float = 600.0
    salt: str | None = None  # put at the very start of each conversation, so an earlier run's cache cannot help
    logprobs: int = 0  # ask for each token's logprob and this many alternatives (0: none)
    # False: each request whole (`stream: false`), what a client that reads every token's logprob needs where a
    # server's stream leaves out the deltas its parsers hold back; no timing then but the end-to-end time
    stream: bool = True

    @property
    def endpoint(self) -> str:
        return self.url.rstrip("/") + "/v1/chat/completions"


def _salted(text: str, salt: str | None) -> str:
    return f"[run {salt}] {text}" if salt else text


def _salted_tools(tools: list[dict[str, Any]], salt: str | None) -> list[dict[str, Any]]:
    """Templates render the tools before every message: the salt goes into the first tool's description."""
    if not salt or not tools:
        return tools
    first = copy.deepcopy(tools[0])
    function = first.setdefault("function", {})
    function["description"] = _salted(str(function.get("description", "")), salt)
    return [first, *tools[1:]]


def _body(conv: Conversation, messages: list[dict[str, Any]], max_tokens: int, settings: Settings) -> dict[str, Any]:
    body: dict[str, Any] = {"model": settings.model, "messages": messages, "stream": settings.stream,
                            "max_tokens": max_tokens, "temperature": 0}
    if settings.stream:
        body["stream_options"] = {"include_usage": True}
    if settings.ignore_eos:
        body["ignore_eos"] = True
    if settings.logprobs:
        body.update(logprobs=True, top_logprobs=settings.logprobs)
    if conv.tools:
        body["tools"] = _salted_tools(conv.tools, settings.salt)
    return body


def _replayed(body: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """A recorded request as it was, streaming with usage, to our model name, salted at its first message."""
    out = copy.deepcopy(body)
    out.update(model=settings.model, stream=True, stream_options={"include_usage": True})
    messages = out.get("messages") or []
    if settings.salt and messages and isinstance(messages[0].get("content"), str):
        messages[0]["content"] = _salted(messages[0]["content"], settings.salt)
    if out.get("tools"):
        out["tools"] = _salted_tools(out["tools"], settings.salt)
    return out


def _failure(exc: httpx.TransportError, status: int | None, elapsed: float) -> tuple[str, str]:
    """The failure class of a transport error. Under the aiohttp transport the original error decides: the
    transport maps a refused connection and a server that hung up alike to a connect *timeout*."""
    cause = exc.__cause__
    if isinstance(cause, (aiohttp.ServerTimeoutError, asyncio.TimeoutError)) or (
            cause is None and isinstance(exc, httpx.TimeoutException)):
        return "timeout", f"{type(cause or exc).__name__} after {elapsed:.1f} s"
    if isinstance(cause, aiohttp.ClientConnectorError) or (cause is None and isinstance(exc, httpx.ConnectError)):
        return "connection", f"{type(cause or exc).__name__}: {cause or exc}"
    if isinstance(cause, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError)) or isinstance(
            exc, (httpx.RemoteProtocolError, httpx.ReadError)):
        return ("stream_aborted" if status == 200 else "connection"), f"{type(cause or exc).__name__}: {cause or exc}"
    return "connection", f"{type(cause or exc).__name__}: {cause or exc}"


async def send(client: httpx.AsyncClient, body: dict[str, Any], record: RequestRecord, settings: Settings,
               run_start: float) -> None:
    """POST one streaming request and fill the record; never raises for a failed request."""
    start = time.perf_counter()
    record.t0 = start - run_start
    parser = Parser()
    usage: dict[str, Any] | None = None
    done = False

    def fail(failure: str, message: str) -> None:
        record.ok, record.failure, record.message = False, failure, message[:500]

    def refused(status: int, raw: str) -> None:
        try:
            error = json.loads(raw)
            message = error.get("message") or json.dumps(error.get("error", error))
        except (json.JSONDecodeError, AttributeError):
            message = raw
        fail("http_4xx" if status < 500 else "http_5xx", f"HTTP {status}: {message}")

    def take(payload: dict[str, Any], now: float) -> None:
        nonlocal usage
        record.chunk_times.append(now)
        if payload.get("usage"):
            usage = payload["usage"]
        is_content, text, finish = content_of(payload)
        if finish:
            record.finish_reason = finish
        if is_content:
            record.content_times.append(now)
            record.reply += text
            record.reasoning += reasoning_of(payload)
            join_tool_calls(record.tool_calls, payload)
        record.logprobs.extend(logprobs_of(payload))

    try:
        if not settings.stream:
            whole = await client.post(settings.endpoint, json=body)
            record.status = whole.status_code
            if whole.status_code >= 400:
                refused(whole.status_code, whole.text)
                return
            try:
                payload = whole.json()
            except json.JSONDecodeError:
                fail("error_event", f"not JSON: {whole.text[:200]}")
                return
            record.e2e = time.perf_counter() - start
            take(payload if isinstance(payload, dict) else {}, record.e2e)
            done = True
        else:
            async with client.stream("POST", settings.endpoint, json=body) as response:
                record.status = response.status_code
                if response.status_code >= 400:
                    refused(response.status_code, (await response.aread()).decode("utf-8", "replace"))
                    return
                async for line in response.aiter_lines():
                    now = time.perf_counter() - start
                    event = parser.feed(line)
                    if event.kind == "skip":
                        continue
                    if event.kind == "done":
                        done = True
                        break
                    if event.kind == "error":
                        fail("error_event", event.raw)
                        return
                    take(event.payload or {}, now)
                record.e2e = time.perf_counter() - start
    except httpx.TransportError as exc:
        fail(*_failure(exc, record.status, time.perf_counter() - start))
        return
    if record.content_times:
        record.ttft, record.last_content = record.content_times[0], record.content_times[-1]
    if usage is None:
        fail("no_usage", "the stream carried no usage (token counts come from usage only)"
             + ("" if done else "; it also ended without [DONE]"))
        return
    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    record.completion_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    record.cache_reported = isinstance(details, dict) and "cached_tokens" in details
    record.cached_tokens = int((details or {}).get("cached_tokens") or 0) if record.cache_reported else 0
    if record.completion_tokens < 1:
        fail("no_usage", "usage reports no completion tokens")
        return
    record.ok = True


async def _within(seconds: float, work: Coroutine[Any, Any, None]) -> None:
    """`work`, cancelled after `seconds` (TimeoutError). A cancellation of the caller always goes on to the caller:
    asyncio.wait_for before Python 3.12 returns the result instead when the cancellation lands in the step that
    finishes `work`, and a worker then took the next request (an interrupted run went on through its queue)."""
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    finally:
        if not task.done():  # cancelled here, or out of time: the request must not outlive this call
            task.cancel()
            await asyncio.wait({task})
    if not done:
        raise asyncio.TimeoutError(f"no answer in {seconds:.0f} s")
    task.result()


async def run(conversations: list[Conversation], settings: Settings, concurrency: int,
              on_done: Callable[[RequestRecord], None] | None = None,
              transport: httpx.AsyncBaseTransport | None = None) -> tuple[list[RequestRecord], float]:
    """Closed loop: `concurrency` workers take conversations in order; returns the records and the wall time."""
    queue: asyncio.Queue[Conversation] = asyncio.Queue()
    for conv in conversations:
        queue.put_nowait(conv)
    records: list[RequestRecord] = []
    counter = itertools.count()
    timeout = httpx.Timeout(settings.timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    # aiohttp underneath by default, the HTTP stack of `vllm bench serve`: measured on the CPU test server, httpx's
    # own stack added 1.5-2 ms to each TTFT (of about 9), beyond the 10% the two clients must agree within
    transport = transport or AiohttpTransport(limits=limits)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:
        run_start = time.perf_counter()

        async def worker(index: int) -> None:
            while not queue.empty():
                conv = queue.get_nowait()
                messages: list[dict[str, Any]] = []
                if conv.system is not None:
                    messages.append({"role": "system", "content": _salted(conv.system, settings.salt)})
                turns: list[Turn | None] = list(conv.turns) if conv.body is None else [None]
                for turn_index, turn in enumerate(turns):
                    record = RequestRecord(f"r{next(counter):05d}", conv.id, turn_index, index, 0.0)
                    if turn is None and conv.body is not None:
                        body = _replayed(conv.body, settings)
                    else:
                        assert turn is not None
                        first = not messages
                        messages.append({"role": "user", "content": _salted(turn.user, settings.salt) if first
                                         else turn.user})
                        body = _body(conv, list(messages), turn.max_tokens or settings.max_tokens, settings)
                    await _within(settings.timeout_s + 30, send(client, body, record, settings, run_start))
                    records.append(record)
                    if on_done is not None:
                        on_done(record)
                    if turn is not None:
                        reply = turn.assistant if turn.assistant is not None else record.reply
                        messages.append({"role": "assistant", "content": reply})

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        wall = time.perf_counter() - run_start
    records.sort(key=lambda r: r.request_id)
    return records, wall
