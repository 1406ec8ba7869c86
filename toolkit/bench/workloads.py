"""The workloads: short prompts, 29 tool schemas, cumulative multi-turn conversations, replayed bodies, and the
platform's recorded replay (request shapes without bodies: what `toolkit estimate` simulates)."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.bench.client import Conversation, Turn
from toolkit.errors import ToolkitError

SHORT_PROMPTS = (
    "Explain what a prefix cache does in a language model server, in two sentences.",
    "List three ways to reduce time to first token when serving long prompts.",
    "Write a short Python function that reverses the words of a sentence.",
    "Summarise the difference between tensor and pipeline parallelism.",
    "What does the SwiGLU activation compute? Answer briefly.",
    "Give a one-paragraph description of chunked prefill.",
    "Name two trade-offs of a larger KV-cache block size.",
    "Describe a gated delta rule in one sentence.",
)
TOOL_NAMES = (
    "get_weather", "search_web", "read_file", "write_file", "list_directory", "run_shell", "http_get", "http_post",
    "query_database", "send_email", "create_calendar_event", "translate_text", "summarize_document", "get_stock_price",
    "convert_currency", "geocode_address", "get_time_zone", "create_ticket", "update_ticket", "search_code",
    "run_tests", "format_code", "lint_code", "compile_project", "deploy_service", "get_metrics", "scale_service",
    "restart_service", "open_pull_request",
)


def tool_schemas() -> list[dict[str, Any]]:
    """29 function schemas of realistic size: the shared prefix an agent workload sends with every request."""
    tools = []
    for i, name in enumerate(TOOL_NAMES):
        params = {f"arg_{j}": {"type": "string" if j % 2 else "integer",
                               "description": f"parameter {j} of {name}: what the call needs to know"}
                  for j in range(3 + i % 4)}
        tools.append({"type": "function", "function": {
            "name": name, "description": f"{name.replace('_', ' ')}: a tool the assistant may call",
            "parameters": {"type": "object", "properties": params, "required": sorted(params)[:2]}}})
    return tools


def short(requests: int) -> list[Conversation]:
    """Single-turn prompts, each distinct from its first words on: a cold prefill every time."""
    return [Conversation(f"short-{i}", [Turn(f"Request {i}. {SHORT_PROMPTS[i % len(SHORT_PROMPTS)]}")])
            for i in range(requests)]


def tools(requests: int) -> list[Conversation]:
    schemas = tool_schemas()
    return [Conversation(f"tools-{i}", [Turn(f"Use the tools if needed: {SHORT_PROMPTS[i % len(SHORT_PROMPTS)]}")],
                         system="You are an agent with tools.", tools=schemas) for i in range(requests)]


def _jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ToolkitError(f"workload file {path}: {exc.strerror}", hint="give an existing JSON lines file") from None
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ToolkitError(f"{path}:{number}: not JSON ({exc.msg})", hint="one JSON object per line") from None
        if not isinstance(item, dict):
            raise ToolkitError(f"{path}:{number}: expected a JSON object")
        out.append((number, item))
    if not out:
        raise ToolkitError(f"{path}: no records")
    return out


def conversations(path: Path, requests: int | None = None) -> list[Conversation]:
    """`{id, system?, tools?, turns: [{user, assistant?, max_tokens?}]}` per line; requests caps the conversations."""
    out = []
    for number, item in _jsonl(path):
        turns = item.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, dict) and "user" in t for t in turns):
            raise ToolkitError(f"{path}:{number}: `turns` must be a list of objects with `user`",
                               hint='e.g. {"id": "c1", "turns": [{"user": "hi"}, {"user": "and then?"}]}')
        out.append(Conversation(str(item.get("id", f"conv-{number}")),
                                [Turn(str(t["user"]), t.get("assistant"), t.get("max_tokens")) for t in turns],
                                system=item.get("system"), tools=item.get("tools")))
    return out[:requests] if requests else out


def replay(path: Path, requests: int | None = None) -> list[Conversation]:
    """One full OpenAI request body per line, like the official replay."""
    if path.suffix == ".csv":
        raise ToolkitError(f"{path}: a replay's shapes (lengths, no bodies) cannot be sent",
                           hint="`toolkit estimate RECIPE --workload replay FILE` predicts it; bench replays a JSON "
                           "lines file of request bodies")
    out = []
    for number, item in _jsonl(path):
        if not isinstance(item.get("messages"), list):
            raise ToolkitError(f"{path}:{number}: a replayed body needs `messages`")
        out.append(Conversation(f"replay-{number}", body=item))
    return out[:requests] if requests else out


def build(kind: str, requests: int | None, file: Path | None) -> tuple[list[Conversation], str | None]:
    """The workload's conversations, and what was left out of a file (None when nothing was): `requests` caps a
    file's conversations (all of them without it), and counts the short and tools requests (8 without it)."""
    if kind == "short":
        return short(requests or 8), None
    if kind == "tools":
        return tools(requests or 8), None
    if file is None:
        raise ToolkitError(f"workload {kind} needs a file", hint=f"--workload {kind} FILE")
    every = conversations(file) if kind == "conversations" else replay(file)
    if requests is None or requests >= len(every):
        return every, None
    return every[:requests], (f"--requests {requests}: the first {requests} of the {len(every)} "
                              f"{'conversations' if kind == 'conversations' else 'requests'} in {file}")


RECORDED_COLUMNS = ("index", "request_id", "prompt_tokens", "output_tokens", "completion_limit")


@dataclass(frozen=True)
class Recorded:
    """One request of the platform's replay as its logs give it (../shared/platform-replay/requests.csv): a length
    is None where no log printed it."""

    index: int
    request_id: str
    prompt_tokens: int | None
    output_tokens: int | None
    completion_limit: int | None  # the request's max_completion_tokens


def recorded(path: Path) -> list[Recorded]:
    """Every row of a replay's shapes file, in dispatch order (its `index` column, which must count 0, 1, 2, ...):
    nothing is dropped; a malformed row is refused with its line."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ToolkitError(f"replay file {path}: {exc.strerror}",
                           hint="give the platform's requests.csv (../shared/platform-replay/requests.csv)") from None
    reader = csv.DictReader(text.splitlines())
    missing = [c for c in RECORDED_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise ToolkitError(f"{path}:1: no column {', '.join(missing)} (header: {', '.join(reader.fieldnames or [])})",
                           hint=f"a replay's shapes file has the columns {', '.join(RECORDED_COLUMNS)}")
    out: list[Recorded] = []
    for row in reader:
        line = reader.line_num

        def number(column: str, row: dict[str, str] = row, line: int = line) -> int | None:
            value = (row.get(column) or "").strip()
            if not value:
                return None
            if not value.isdigit() or (column != "index" and int(value) < 1):
                raise ToolkitError(f"{path}:{line}: {column} {value!r} is not a count",
                                   hint="a whole number of tokens, or empty where the logs do not give it")
            return int(value)

        index = number("index")
        if index != len(out):
            raise ToolkitError(f"{path}:{line}: index {index} where {len(out)} comes next",
                               hint="rows in dispatch order, indexed from 0 without a gap")
        out.append(Recorded(len(out), (row.get("request_id") or "").strip(), number("prompt_tokens"),
                            number("output_tokens"), number("completion_limit")))
    if not out:
        raise ToolkitError(f"{path}: no requests")
    return out
