"""The body that replaces vLLM 0.6.3's `Hermes2ProToolParser.extract_tool_calls_streaming` (transform
hermes-streaming-settled-arguments, layers/vllm063-openai.yaml).

0.6.3's streaming parser diffs the json.dumps of successive partial parses. A partial string argument is
auto-completed with its closing quote, so the first delta of a string value already carries the `"` that closes it
(`"arg_1": ""Paris`), and at `</tool_call>` the parser removes what it streamed from the final arguments with
`str.replace`: the streamed text no longer being a prefix of them, the whole arguments are sent a second time. A
client reads `{"arg_1": ""Paris{"arg_1": "Paris"}` and cannot parse it.

This body streams, for each call, only the settled prefix of its final arguments: the json.dumps of the arguments
parsed without partial strings (a string is sent once it is closed), less the brackets the parser closed for it and
less a scalar at its end (a number may still grow, and a partial one may parse as another: `-` as 0). A nested
container grows at its end, so each settled prefix is a prefix of the next and of the final text; at `</tool_call>`
the rest of the final json.dumps is sent. The parser's state is what serving_chat reads when a stream finishes:
`prev_tool_call_arr[i]` holds call i's parsed name and arguments; `sent_args_for_tool[i]` (this body's own) what
was sent of them, always a prefix of `json.dumps(arguments)`; `streamed_args_for_tool[i]` what was sent before the
latest delta of them, because a stream's last delta carrying arguments is replaced by json.dumps(arguments) less
it.

Only the body is used: the names it reads are the hermes module's own (json, re, partial_json_parser, Allow,
DeltaMessage, DeltaToolCall, DeltaFunctionCall, random_uuid, logger). The imports below are those names, for
readers and linters; they resolve where vLLM 0.6.3 is installed.
"""

import json
import re
from collections.abc import Sequence
from typing import Any

import partial_json_parser
from partial_json_parser.core.options import Allow
from vllm.entrypoints.openai.protocol import ChatCompletionRequest, DeltaFunctionCall, DeltaMessage, DeltaToolCall
from vllm.logger import init_logger
from vllm.utils import random_uuid

logger = init_logger(__name__)


class Hermes2ProToolParser:
    current_tool_name_sent: bool
    prev_tool_call_arr: list[dict[str, Any]]
    current_tool_id: int
    streamed_args_for_tool: list[str]
    tool_call_start_token: str
    tool_call_end_token: str
    tool_call_start_token_id: int

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: ChatCompletionRequest,
    ) -> DeltaMessage | None:
        if self.tool_call_start_token_id not in current_token_ids:
            return DeltaMessage(content=delta_text)

        def split(text: str) -> tuple[str, list[tuple[str, bool]]]:
            # the text outside the calls, and each call's body with whether it is closed
            outside: list[str] = []
            calls: list[tuple[str, bool]] = []
            rest = text
            while True:
                before, opened, rest = rest.partition(self.tool_call_start_token)
                outside.append(before)
                if not opened:
                    return "".join(outside), calls
                body, closed, rest = rest.partition(self.tool_call_end_token)
                calls.append((body, bool(closed)))
                if not closed:
                    return "".join(outside), calls

        try:
            previous_outside, _ = split(previous_text)
            outside, calls = split(current_text)
            content = outside[len(previous_outside):] if outside.startswith(previous_outside) else ""
            deltas: list[DeltaToolCall] = []
            sent: list[str] = self.__dict__.setdefault("sent_args_for_tool", [])
            for index, (body, closed) in enumerate(calls):
                if index == len(self.prev_tool_call_arr):
                    self.prev_tool_call_arr.append({})
                    self.streamed_args_for_tool.append("")
                    sent.append("")
                    self.current_tool_id = index
                    self.current_tool_name_sent = False
                call: Any = None
                if closed:
                    try:
                        call = json.loads(body)
                    except json.JSONDecodeError:
                        if self.tool_call_end_token in delta_text:  # said once, as it closes
                            logger.error("tool call %d is not JSON: %r", index, body)
                        continue
                elif body.strip():
                    try:
                        call = partial_json_parser.loads(body, Allow.ALL & ~Allow.STR)
                    except (partial_json_parser.core.exceptions.MalformedJSON, json.JSONDecodeError):
                        continue
                if not isinstance(call, dict):
                    continue
                name = call.get("name")
                arguments = call.get("arguments")
                if not isinstance(name, str) or not name:
                    continue
                if "name" not in self.prev_tool_call_arr[index]:
                    deltas.append(DeltaToolCall(index=index, type="function", id=f"chatcmpl-tool-{random_uuid()}",
                                                function=DeltaFunctionCall(name=name).model_dump(exclude_none=True)))
                    self.current_tool_name_sent = True
                # no "arguments" key rather than None: serving_chat reads .get("arguments", {})
                self.prev_tool_call_arr[index] = {"name": name} if arguments is None else {"name": name,
                                                                                         "arguments": arguments}
                if arguments is None:
                    settled = "{}" if closed else ""
                elif closed:
                    settled = json.dumps(arguments)
                else:
                    # a scalar at the end may still grow or change (`-` parses as 0, `-0.` as -0.0 before -0.25)
                    settled = re.sub(r"(-?[0-9][0-9.eE+-]*|true|false|null)$", "",
                                     json.dumps(arguments).rstrip("]}"))
                streamed = sent[index]
                if len(settled) > len(streamed):
                    if not settled.startswith(streamed):
                        logger.error("tool call %d: streamed arguments %r are not a prefix of %r", index, streamed,
                                     settled)
                        continue
                    # serving_chat 0.6.3 replaces a stream's last delta that carries arguments by
                    # json.dumps(arguments) less streamed_args_for_tool: that is this delta's text only while
                    # streamed_args_for_tool does not count it yet
                    self.streamed_args_for_tool[index] = streamed
                    sent[index] = settled
                    deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(
                        arguments=settled[len(streamed):]).model_dump(exclude_none=True)))
            if deltas:
                return DeltaMessage(tool_calls=deltas, content=content or None)
            if content or not calls or calls[-1][1]:
                # outside a call every token answers, as 0.6.3's does: serving_chat sends a stream's finish only
                # with a delta
                return DeltaMessage(content=content)
            return None
        except Exception as e:
            logger.error("Error trying to handle streaming tool call: %s", e)
            return None
