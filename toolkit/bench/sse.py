"""Server-sent events as OpenAI-compatible servers send them: `data:` with or without a space, comments,
`event:` lines (only `event: error` matters), CRLF, and the `[DONE]` sentinel."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Event:
    kind: str  # "data", "done", "error", "skip"
    payload: dict[str, Any] | None = None
    raw: str = ""


class Parser:
    """Turns lines into events; remembers an `event: error` line for the data line that follows it."""

    def __init__(self) -> None:
        self._pending_error = False

    def feed(self, line: str) -> Event:
        line = line.rstrip("\r\n")
        if not line or line.startswith(":"):
            return Event("skip")
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "event":
            self._pending_error = value.strip() == "error"
            return Event("skip")
        if field != "data":
            return Event("skip")
        if value.strip() == "[DONE]":
            return Event("done")
        try:
            payload = json.loads(value)
        except json.JSONDecodeError:
            return Event("error", None, f"not JSON: {value[:200]}")
        if not isinstance(payload, dict):
            return Event("error", None, f"not a JSON object: {value[:200]}")
        if self._pending_error or "error" in payload:
            self._pending_error = False
            error = payload.get("error", payload)
            message = error.get("message", str(error)) if isinstance(error, dict) else str(error)
            return Event("error", payload, message)
        return Event("data", payload)


def content_of(payload: dict[str, Any]) -> tuple[bool, str, str | None]:
    """(is a content event, the visible text it adds, its finish reason) for one chunk."""
    has_content = False
    text = ""
    finish = None
    for choice in payload.get("choices") or []:
        delta = choice.get("delta") or choice.get("message") or {}
        for key in ("content", "reasoning_content", "reasoning"):
            value = delta.get(key)
            if isinstance(value, str) and value:
                has_content = True
                if key == "content":
                    text += value
        if delta.get("tool_calls"):
            has_content = True
        finish = choice.get("finish_reason") or finish
    return has_content, text, finish


def join_tool_calls(calls: list[dict[str, Any]], payload: dict[str, Any]) -> None:
    """Add one chunk's tool-call deltas to `calls` ({"name", "arguments"} by the delta's index): a name comes once,
    the arguments in pieces."""
    for choice in payload.get("choices") or []:
        delta = choice.get("delta") or choice.get("message") or {}
        for call in delta.get("tool_calls") or []:
            index = int(call.get("index", len(calls)))
            while len(calls) <= index:
                calls.append({"name": "", "arguments": ""})
            function = call.get("function") or {}
            calls[index]["name"] += function.get("name") or ""
            arguments = function.get("arguments")
            calls[index]["arguments"] += arguments if isinstance(arguments, str) else ""


def reasoning_of(payload: dict[str, Any]) -> str:
    """The reasoning text one chunk adds (`reasoning_content`, or `reasoning` as newer servers name it)."""
    text = ""
    for choice in payload.get("choices") or []:
        delta = choice.get("delta") or choice.get("message") or {}
        value = delta.get("reasoning_content") or delta.get("reasoning")
        text += value if isinstance(value, str) else ""
    return text


def logprobs_of(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The tokens one chunk carries with their logprobs (a request with `logprobs` and `top_logprobs`)."""
    out = []
    for choice in payload.get("choices") or []:
        for item in (choice.get("logprobs") or {}).get("content") or []:
            top = {str(t.get("token")): float(t.get("logprob", 0.0)) for t in item.get("top_logprobs") or []}
            out.append({"token": str(item.get("token")), "logprob": float(item.get("logprob", 0.0)), "top": top})
    return out
