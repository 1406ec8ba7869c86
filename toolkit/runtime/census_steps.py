"""The steps a census counts, run by the CPU runtime's Python as a script: `python census_steps.py PLAN.json`.

vLLM's own engine (the patched tree's LLMEngine, built from the served argv as its OpenAI server's parser reads it)
is given requests of known shapes and stepped one step at a time, so each step's shape is known: a prefill of each
asked length alone (one request, one token), then for each asked batch that many requests prefilled together and
decoded together for the asked number of steps. Prompts are random token ids (no prefix-cache hit), every answer runs
its full length (`ignore_eos`), nothing is detokenized (the wide model has no tokenizer). What each rank ran in each
step is the census's (TOOLKIT_CENSUS); this script writes the steps' shapes, in order, to the plan's `labels` file.
Standard library and the tree's vLLM only: it runs where the toolkit is not installed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
from typing import Any


def _stop_group(signum: int, frame: object) -> None:
    # this script leads its session: its engine's workers, which spin when their driver is gone, end with it
    os.killpg(0, signal.SIGKILL)


def main(plan_file: str) -> None:
    signal.signal(signal.SIGTERM, _stop_group)
    with open(plan_file, encoding="utf-8") as source:
        plan: dict[str, Any] = json.load(source)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.engine.llm_engine import LLMEngine
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.sampling_params import SamplingParams
    from vllm.utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(plan["args"])
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    rng = random.Random(0)
    labels: list[dict[str, Any]] = []
    counter = 0

    def run(prompt_tokens: int, batch: int, max_tokens: int, expected: list[dict[str, Any]]) -> None:
        nonlocal counter
        for _ in range(batch):
            prompt = [rng.randrange(16, plan["vocab"]) for _ in range(prompt_tokens)]
            engine.add_request(f"census-{counter}", {"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                                              temperature=0.0))
            counter += 1
        ran = 0
        while engine.has_unfinished_requests():
            engine.step()
            ran += 1
        if ran != len(expected):
            raise SystemExit(f"census: {batch} request(s) of {prompt_tokens} prompt tokens and {max_tokens} answer "
                             f"tokens ran {ran} steps, not {len(expected)}: the plan's budget does not fit them")
        labels.extend(expected)
        print(f"[census] {batch} x {prompt_tokens} prompt tokens, {max_tokens} answer token(s): {ran} step(s)",
              file=sys.stderr, flush=True)

    for tokens in plan["prefills"]:
        run(tokens, 1, 1, [{"decodes": [], "prefills": [tokens]}])
    prompt, steps = plan["decode_prompt"], plan["decode_steps"]
    for batch in plan["batches"]:
        run(prompt, batch, steps + 1, [{"decodes": [], "prefills": [prompt] * batch}] + [
            {"decodes": [prompt + 1 + i] * batch, "prefills": []} for i in range(steps)])
    with open(plan["labels"], "w", encoding="utf-8") as out:
        json.dump(labels, out)


if __name__ == "__main__":
    main(sys.argv[1])
