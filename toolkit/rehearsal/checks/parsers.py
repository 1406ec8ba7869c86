"""parsers: the tiny model's output forced into the model family's formats (a tool call, two, an argument holding
XML-like text, reasoning ending in `</think>`, reasoning with no end), as the served tokenizer's own ids, and the
server's registered tool and reasoning parsers must split what it generated, streamed and not, as the client
expects."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from toolkit.bench import client, experiment, sse, workloads
from toolkit.bench.metrics import RequestRecord
from toolkit.bench.serve import Server
from toolkit.rehearsal.checks.base import RehearsalCheck
from toolkit.rehearsal.model import Check, Substitution
from toolkit.rehearsal.requests import kept, streamed
from toolkit.rehearsal.servers import Live, Stage

FORCING = Substitution("guided_regex (parsers requests)", None, "the served tokenizer's own ids of the one string it "
                       "matches, forced one per step (the CPU runtime's forced-literal-tokens)",
                       "a random model writes no tool call; forced as ids, each special token reaches the parsers as "
                       "its one id, as the real model emits it (a token-id parser sees what it would on the platform)")



@dataclass(frozen=True)
class Forced:
    """One forced output and what the client must get from it: the reasoning, ended by `</think>` unless the output
    has nothing after it (then it never ends), the content after it, the tool calls (name, arguments)."""

    name: str
    reasoning: str
    content: str
    calls: tuple[tuple[str, dict[str, Any]], ...] = ()

    def text(self, reasoning_on: bool, tool_parser: str = "qwen3_coder") -> str:
        body = self.content + "".join(CALL_FORMATS[tool_parser](n, a) for n, a in self.calls)
        if not reasoning_on:
            return body
        return f"{self.reasoning}</think>\n\n{body}" if body else self.reasoning

    def expected(self, reasoning_on: bool) -> dict[str, Any]:
        if not reasoning_on:
            return {"reasoning": "", "content": self.content.strip(), "calls": [list(c) for c in self.calls]}
        return {"reasoning": self.reasoning.strip(), "content": self.content.strip(),
                "calls": [list(c) for c in self.calls]}


def _qwen3_coder_call(name: str, arguments: dict[str, Any]) -> str:
    params = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>\n"


def _hermes_call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>\n"


# how each tool parser's model family writes a call (the parsers check forces the served parser's)
CALL_FORMATS: dict[str, Callable[[str, dict[str, Any]], str]] = {
    "qwen3_coder": _qwen3_coder_call, "hermes": _hermes_call}


def literal(text: str) -> str:
    """`text` as a regex that matches only it (outlines' regex dialect: newlines as \n, metacharacters escaped)."""
    return "".join("\\n" if c == "\n" else ("\\" + c if c in ".^$*+?{}[]|()\\" else c) for c in text)


def forced_outputs(tools: list[dict[str, Any]]) -> list[Forced]:
    """A tool call, two tool calls, a call whose argument holds XML-like text, reasoning that ends in `</think>`
    and reasoning that does not end; the arguments typed by the tools' schemas (an integer, a string)."""
    def keys(tool: dict[str, Any]) -> tuple[str, str, str]:
        props = tool["function"]["parameters"]["properties"]
        number = next(k for k, v in props.items() if v.get("type") == "integer")
        return tool["function"]["name"], number, next(k for k, v in props.items() if v.get("type") == "string")

    (first, n1, s1), (second, n2, s2) = keys(tools[0]), keys(tools[1])
    return [
        Forced("a tool call", "The user wants the weather.", "", ((first, {n1: 7, s1: "Paris"}),)),
        Forced("two tool calls", "Two tools are needed.", "", ((first, {n1: 1, s1: "Oslo"}),
                                                                (second, {n2: 2, s2: "Rome"}))),
        Forced("an argument holding XML-like text", "The argument is markup.", "",
               ((first, {n1: 3, s1: "<b>bold</b> & <i>x</i>"}),)),
        Forced("reasoning ending in </think>", "Two and two.", "The answer is 4."),
        Forced("reasoning with no end", "Still thinking about it", ""),
    ]


async def non_streamed(stage: Stage, server: Server, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same requests with `stream: false`, all at once: what a client gets from the non-streaming path."""
    async def one(http: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = await http.post(server.url.rstrip("/") + "/v1/chat/completions",
                                       json={**body, "model": server.model, "stream": False})
        except httpx.HTTPError as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        if response.status_code != 200:
            cause = f"; the server's log: {stage.server_error(server)}" if response.status_code >= 500 else ""
            return {"error": f"HTTP {response.status_code}: {response.text[:300]}{cause}"}
        payload = response.json()
        calls: list[dict[str, Any]] = []
        sse.join_tool_calls(calls, payload)
        message = (payload.get("choices") or [{}])[0].get("message") or {}
        return got(sse.reasoning_of(payload), message.get("content") or "", calls)

    async with httpx.AsyncClient(timeout=300) as http:
        return list(await asyncio.gather(*(one(http, body) for body in bodies)))


def got(reasoning: str, content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client reads: the texts stripped, each call's arguments parsed as JSON (unparsable: kept as text)."""
    parsed: list[list[Any]] = []
    for call in calls:
        try:
            parsed.append([call["name"], json.loads(call["arguments"])])
        except ValueError:
            parsed.append([call["name"], f"(not JSON) {call['arguments']}"])
    return {"reasoning": reasoning.strip(), "content": content.strip(), "calls": parsed}




class Parsers(RehearsalCheck):
    name = "parsers"
    summary = "tool and reasoning outputs forced as the family's token ids, parsed streamed and not"
    concurrent = True
    servers = ("served",)

    def not_applicable(self) -> str | None:
        if not self.run.reasoning and not self.run.tool_parser:
            return "the run config serves neither a tool parser nor a reasoning parser"
        return None


    def on(self, server: str, live: Live) -> None:
        stage, reasoning_on, tool_parser = self.run.stage, self.run.reasoning, self.run.tool_parser
        stage.rehearsal.substitute(FORCING)
        if tool_parser is not None and tool_parser not in CALL_FORMATS:
            self.result = Check("parsers", False, f"no forced format for tool parser {tool_parser} (the check knows "
                                f"{', '.join(CALL_FORMATS)}): its tool calls cannot be checked here")
            return
        # the two tools called (the 29-schema prompt is the tools check's): the parser types arguments by them
        tools = workloads.tool_schemas()[:2]
        cases = [c for c in forced_outputs(tools)
                 if (tool_parser or not c.calls) and (reasoning_on or c.content or c.calls)]
        bodies = {}
        for case in cases:
            text = case.text(reasoning_on, tool_parser or "qwen3_coder")
            bodies[case.name] = {
                "messages": [{"role": "user", "content": "What is the weather in Paris, and in Oslo?"}],
                **({"tools": tools, "tool_choice": "auto"} if tool_parser else {}),
                # one token a byte at worst, and the end of sequence
                "guided_regex": literal(text), "max_tokens": len(text.encode()) + 8, "temperature": 0}

        async def both() -> tuple[tuple[list[RequestRecord], float], list[dict[str, Any]]]:
            # streamed and not at once: one batch of decode steps instead of two (each forced output is long)
            as_streamed, whole = await asyncio.gather(
                streamed(live.server, [client.Conversation(name, body=body) for name, body in bodies.items()],
                         len(bodies)),
                non_streamed(stage, live.server, list(bodies.values())))
            return as_streamed, whole

        (streamed_records, _), wholes = asyncio.run(both())
        by_name = {r.conversation: r for r in kept(stage, live.server, streamed_records, "parsers")}
        problems = []
        for case, whole in zip(cases, wholes, strict=True):
            want = case.expected(reasoning_on)
            record = by_name[case.name]
            as_streamed = (got(record.reasoning, record.reply, record.tool_calls) if record.ok
                           else {"error": f"HTTP {record.status}: {record.failure}: {record.message}"})
            for how, seen in (("streamed", as_streamed), ("not streamed", whole)):
                if seen != want:
                    problems.append(f"{case.name}, {how}: got {seen}, expected {want}")
        skipped = ("" if tool_parser else "; the tool-call cases not sent: the run config has no "
                   "--enable-auto-tool-choice/--tool-call-parser")
        parsers = " and the ".join(p for p in (f"tool parser {tool_parser}" if tool_parser else "",
                                               f"reasoning parser "
                                               f"{experiment.flag_value(self.run.served, '--reasoning-parser')}"
                                               if reasoning_on else "") if p)
        self.result = Check("parsers", not problems, "; ".join(problems) or (
            f"{len(cases)} outputs forced as the served tokenizer's ids ({', '.join(c.name for c in cases)}), "
            f"streamed and not: the {parsers} split them as the client expects{skipped}"))
