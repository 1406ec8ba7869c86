"""layers/vllm063-openai.yaml: vLLM 0.6.3's own hermes parser, streamed, and the body that replaces it, driven token
by token as 0.6.3's serving_chat drives it (its finish fix-up included) in the CPU runtime's vLLM 0.6.3; what a
client reassembles from the deltas must parse to the arguments the model wrote. The cached-token usage is checked
end to end by the rehearsal of recipes/bi100-qwen25.yaml (tests/test_rehearse.py). The image layer's completion limit
that must fit the context (layers/corex-3.2.3.yaml), on 0.6.3's own serving_engine and protocol."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

from toolkit.engine.evaluate import evaluate
from toolkit.recipe import load_recipe
from toolkit.runtime.env import runtime
from toolkit.transforms import edit_kind
from toolkit.transforms.base import Context

HERMES = "vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py"
QWEN25 = REPO / "recipes" / "bi100-qwen25.yaml"
TAGS = re.compile(r"(<tool_call>|</tool_call>)")

# serving_chat 0.6.3's streaming loop for one choice with tool_choice auto, with the layer's
# stream-finish-after-held-token: the parser's delta per token, None skipped except on the last token (then an
# empty delta carries the finish), and on the last token its fix-up of a delta carrying arguments
DRIVER = r"""
import json, sys
from vllm.entrypoints.openai.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall
import importlib

class Tokenizer:
    def get_vocab(self):
        return {"<tool_call>": 1, "</tool_call>": 2}

def stream(parser_class, pieces):
    parser = parser_class(Tokenizer())
    ids = {"<tool_call>": 1, "</tool_call>": 2}
    text, token_ids, client = "", [], {"content": "", "calls": {}, "finished": False}
    for n, piece in enumerate(pieces):
        delta_ids = [ids.get(piece, 100 + n)]
        delta = parser.extract_tool_calls_streaming(text, text + piece, piece, token_ids, token_ids + delta_ids,
                                                    delta_ids, None)
        text, token_ids = text + piece, token_ids + delta_ids
        last = n == len(pieces) - 1
        if delta is None:
            if not last:
                continue
            delta = DeltaMessage()
        client["finished"] = last
        if (last and delta.tool_calls and delta.tool_calls[0].function
                and delta.tool_calls[0].function.arguments is not None):
            index = len(parser.prev_tool_call_arr) - 1
            expected = json.dumps(parser.prev_tool_call_arr[index].get("arguments", {}))
            remaining = expected.replace(parser.streamed_args_for_tool[index], "", 1)
            delta = DeltaMessage(tool_calls=[DeltaToolCall(index=index, function=DeltaFunctionCall(
                arguments=remaining).model_dump(exclude_none=True))])
        client["content"] += delta.content or ""
        for call in delta.tool_calls or []:
            got = client["calls"].setdefault(call.index, {"name": "", "arguments": ""})
            got["name"] += (call.function.name if call.function else None) or ""
            got["arguments"] += (call.function.arguments if call.function else None) or ""
    return client

request = json.loads(sys.stdin.read())
out = {}
for module in request["modules"]:
    parser_class = importlib.import_module(module).Hermes2ProToolParser
    out[module] = [stream(parser_class, pieces) for pieces in request["cases"]]
print(json.dumps(out))
"""


def pieces(text: str, size: int, end: str | None = "") -> list[str]:
    """The text as a model streams it: each tag one token, the rest in pieces of `size` characters, then `end` (the
    end-of-sequence token's text, none when the stream ends on the text's last token)."""
    out: list[str] = []
    for part in TAGS.split(text):
        if TAGS.fullmatch(part):
            out.append(part)
        else:
            out.extend(part[i:i + size] for i in range(0, len(part), size))
    return [*out, end] if end is not None else out


def call(name: str, arguments: dict[str, Any] | None) -> str:
    body = {"name": name} if arguments is None else {"name": name, "arguments": arguments}
    return f"<tool_call>\n{json.dumps(body)}\n</tool_call>"


WEATHER = {"city": "Paris", "days": 12}
NESTED = {"filter": {"tags": ["a", "b <i>"], "limit": 5, "ratio": -0.25}, "q": "x}]y", "on": True, "none": None}
# (what the model writes, how it is cut, the content and calls a client must read)
CASES: list[tuple[str, list[str], str, list[tuple[str, dict[str, Any]]]]] = [
    ("a call, cut as a BPE tokenizer cuts it",
     ["<tool_call>", "\n", '{"', "name", '":', ' "', "get", "_weather", '",', ' "', "arguments", '":', ' {"', "city",
      '":', ' "', "Par", "is", '",', ' "', "days", '":', " ", "1", "2", "}}", "\n", "</tool_call>", ""],
     "", [("get_weather", WEATHER)]),
    ("a call, one character a token", pieces(call("get_weather", WEATHER), 1), "", [("get_weather", WEATHER)]),
    ("nested arguments, three characters a token", pieces(call("search", NESTED), 3), "", [("search", NESTED)]),
    ("content, then two calls, five characters a token",
     pieces("Sure.\n" + call("get_weather", WEATHER) + "\n" + call("search", NESTED), 5), "Sure.",
     [("get_weather", WEATHER), ("search", NESTED)]),
    ("a call without arguments", pieces(call("now", None), 2), "", [("now", {})]),
    ("the stream ends at </tool_call>", pieces(call("get_weather", WEATHER), 4, end=None), "",
     [("get_weather", WEATHER)]),
    ("a call without a name, then a valid one",
     pieces('<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>\n' + call("get_weather", WEATHER) + "\nbye", 3),
     "bye", [("get_weather", WEATHER)]),
]
# a stream cut inside a call (max_tokens, a stop string): what was sent is a prefix of the arguments' JSON, or, where
# the last token carried arguments, serving_chat's fix-up completed them from the partial parse
CUT = {"city": "Paris", "days": -12.5, "tags": ["a", "b"]}
CUTS = [pieces(call("get_weather", CUT)[:n], 2, end=None) for n in (30, 50, 60, 75)]


def read(client: dict[str, Any]) -> dict[str, Any]:
    """What a client makes of the deltas: the content stripped, each call's arguments parsed (unparsable: text)."""
    calls = []
    for index in sorted(client["calls"], key=int):
        got = client["calls"][index]
        try:
            arguments = json.loads(got["arguments"] or "{}")
        except json.JSONDecodeError:
            arguments = "(not JSON) " + got["arguments"]
        calls.append([got["name"], arguments])
    return {"content": client["content"].strip(), "calls": calls}


def both(vllm_063: Path, rel: str, transform: str, folder: Path, names: tuple[str, str]) -> None:
    """`rel` as vLLM 0.6.3 has it and as the layer's `transform` writes it, as two modules in `folder`."""
    original = (vllm_063 / rel).read_bytes()
    [spec] = [t for t in load_recipe(QWEN25).recipe.transforms if t.id == transform]
    patched = evaluate(rel, original, [edit_kind(spec, Context(patches_dir=REPO / "patches" / "src"))], None)
    assert patched.text is not None
    (folder / f"{names[0]}.py").write_bytes(original)
    (folder / f"{names[1]}.py").write_text(patched.text, encoding="utf-8")


@pytest.fixture(scope="module")
def streamed(vllm_063: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("hermes")
    both(vllm_063, HERMES, "hermes-streaming-settled-arguments", folder, ("hermes_063", "hermes_settled"))
    proc = subprocess.run([str(runtime()), "-c", DRIVER], input=json.dumps(
        {"modules": ["hermes_063", "hermes_settled"], "cases": [*(c[1] for c in CASES), *CUTS]}), capture_output=True,
        text=True, cwd=folder, env={**os.environ, "PYTHONPATH": f"{folder}:{vllm_063}"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, list[dict[str, Any]]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_the_settled_body_streams_arguments_a_client_can_parse(streamed: dict[str, Any], case: int) -> None:
    _, _, content, calls = CASES[case]
    assert read(streamed["hermes_settled"][case]) == {"content": content, "calls": [list(c) for c in calls]}


def test_vllm_063s_own_body_garbles_string_arguments(streamed: dict[str, Any]) -> None:
    """The defect the transform removes, seen by the same driver: 0.6.3's body sends a string argument's quote out
    of place and, its streamed text then being no prefix of the arguments, the whole arguments again at
    </tool_call>."""
    garbled = [read(r)["calls"] for r in streamed["hermes_063"][:2]]
    for calls in garbled:
        assert isinstance(calls[0][1], str) and calls[0][1].startswith("(not JSON)"), calls
        assert calls[0][1].endswith('12{"city": "Paris", "days": 12}'), calls


@pytest.mark.parametrize("cut", range(len(CUTS)))
def test_a_stream_cut_inside_a_call_sent_a_prefix_of_its_arguments_and_finished(streamed: dict[str, Any],
                                                                                 cut: int) -> None:
    client = streamed["hermes_settled"][len(CASES) + cut]
    assert client["finished"], "the last token's chunk went out"
    for got in client["calls"].values():
        assert got["name"] == "get_weather"
        if not json.dumps(CUT).startswith(got["arguments"]):
            completed = json.loads(got["arguments"])
            assert set(completed) <= set(CUT) and all(CUT[k] == v for k, v in completed.items()), completed


SEQUENCE = "vllm/sequence.py"
NO_NEW_TOKENS = """
import importlib.util, json, sys
from vllm.sequence import Logprob
out = {}
for name in sys.argv[1:]:
    spec = importlib.util.spec_from_file_location(name, name + ".py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    seq = module.Sequence(0, {"prompt_token_ids": [1, 2, 3]}, 16)
    chunk = seq.get_output_token_ids_to_return(True)  # a prefill chunk's step: nothing sampled
    seq.append_token_id(7, {7: Logprob(0.0)})
    out[name] = [list(chunk), seq.get_output_token_ids_to_return(True)]
print(json.dumps(out))
"""


def test_a_step_that_samples_nothing_returns_no_tokens(vllm_063: Path, tmp_path: Path) -> None:
    """0.6.3 returns the whole prompt as a chunked prefill step's new tokens; the layer's guard returns none, and
    the token a later step samples still comes out alone."""
    both(vllm_063, SEQUENCE, "delta-output-no-new-tokens", tmp_path, ("sequence_063", "sequence_guarded"))
    proc = subprocess.run([str(runtime()), "-c", NO_NEW_TOKENS, "sequence_063", "sequence_guarded"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}:{vllm_063}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"sequence_063": [[1, 2, 3], 7], "sequence_guarded": [[], 7]}


SERVING_ENGINE = "vllm/entrypoints/openai/serving_engine.py"
PROTOCOL = "vllm/entrypoints/openai/protocol.py"
# each case: prompt tokens, the request's limits; what 0.6.3's _validate_input then leaves of them and what the
# sampling gets, or the error it raises (the context is 100 tokens)
LIMITS = r"""
import importlib.util, json, sys
from types import SimpleNamespace

def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

import vllm.entrypoints.openai  # the package, before its modules are put in place
protocol = load("vllm.entrypoints.openai.protocol", sys.argv[1])
serving = load("vllm.entrypoints.openai.serving_engine", sys.argv[2])
out = []
for prompt, limits in json.loads(sys.stdin.read()):
    request = protocol.ChatCompletionRequest(model="llm", messages=[{"role": "user", "content": "hi"}], **limits)
    try:
        serving.OpenAIServing._validate_input(SimpleNamespace(max_model_len=100), request, [1] * prompt, "hi")
    except ValueError as exc:
        out.append({"error": str(exc)})
        continue
    sampling = request.to_sampling_params(100 - prompt)
    out.append({"max_tokens": request.max_tokens, "max_completion_tokens": request.max_completion_tokens,
                "sampled": sampling.max_tokens})
print(json.dumps(out))
"""
LIMIT_CASES = [(90, {"max_tokens": 50}), (90, {"max_completion_tokens": 50}), (90, {"max_tokens": 5}),
               (40, {"max_tokens": 60}), (90, {}), (100, {"max_tokens": 5}), (100, {})]


def test_a_completion_limit_beyond_the_context_is_cut_to_the_room_left(vllm_063: Path, tmp_path: Path) -> None:
    """The platform's replay asks up to 65,536 completion tokens of prompts up to 254,336: 0.6.3 refuses each one
    whose prompt fits but whose limit does not; the layer serves it with the limit cut to the room the prompt leaves,
    and a prompt that alone fills the context keeps vLLM's own refusal."""
    protocol = load_recipe(QWEN25).recipe.transforms
    context = Context(patches_dir=REPO / "patches" / "src")
    edits = [edit_kind(t, context) for t in protocol if t.id.startswith("openai-max-completion-tokens")
             or t.id == "openai-accept-unknown-fields"]
    patched_protocol = evaluate(PROTOCOL, (vllm_063 / PROTOCOL).read_bytes(), edits, None).text
    assert patched_protocol is not None
    (tmp_path / "protocol.py").write_text(patched_protocol, encoding="utf-8")
    both(vllm_063, SERVING_ENGINE, "openai-completion-limit-fits", tmp_path, ("engine_063", "engine_fits"))

    def run(engine: str) -> list[dict[str, Any]]:
        proc = subprocess.run([str(runtime()), "-c", LIMITS, str(tmp_path / "protocol.py"),
                               str(tmp_path / f"{engine}.py")], input=json.dumps(LIMIT_CASES), capture_output=True,
                              text=True, cwd=tmp_path, timeout=300, env={**os.environ, "PYTHONPATH": str(vllm_063)})
        assert proc.returncode == 0, proc.stderr[-3000:]
        result: list[dict[str, Any]] = json.loads(proc.stdout.strip().splitlines()[-1])
        return result

    refused = ("This model's maximum context length is 100 tokens. However, you requested 105 tokens (100 in the "
               "messages, 5 in the completion). Please reduce the length of the messages or completion.")
    assert run("engine_fits") == [
        {"max_tokens": 10, "max_completion_tokens": None, "sampled": 10},
        {"max_tokens": None, "max_completion_tokens": 10, "sampled": 10},
        {"max_tokens": 5, "max_completion_tokens": None, "sampled": 5},
        {"max_tokens": 60, "max_completion_tokens": None, "sampled": 60},
        {"max_tokens": None, "max_completion_tokens": None, "sampled": 10},
        {"error": refused},
        {"error": "This model's maximum context length is 100 tokens. However, you requested 100 tokens in the "
                  "messages, Please reduce the length of the messages."}]
    # vLLM 0.6.3 as shipped: the first request is refused (max_completion_tokens alone is not checked there at all)
    shipped = run("engine_063")
    assert shipped[0] == {"error": refused.replace("105 tokens (100 in the messages, 5", "140 tokens (90 in the "
                                                   "messages, 50")}
    assert shipped[1] == {"max_tokens": None, "max_completion_tokens": 50, "sampled": 50}
