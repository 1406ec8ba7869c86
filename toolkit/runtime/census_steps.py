"""The steps a census counts, run by the CPU runtime's Python as a script: `python census_steps.py PLAN.json`.

vLLM's own engine (the patched tree's LLMEngine, built from the served argv as its OpenAI server's parser reads it)
is given requests of known shapes and stepped one step at a time, so each step's shape is known: a prefill of each
asked length alone (one request, one token), then for each asked batch that many requests prefilled together and
decoded together for the asked number of steps, then for each asked context one request of that many prompt tokens
and a chunk more, at a token budget of one chunk: a first chunk computed from the start (a served path may carry its
state to the next chunk, as the exact checkpoints do), then the rest of the context counted as computed, so the next
step is a chunk at that depth (its prefix attention over the context's blocks, as a long prompt's later chunk runs
it), then its decodes at that context (above 32,768 tokens the adapter's PyTorch paged attention and its KV gather
kernel). The skipped blocks are allocated and never written: what runs, and its shapes, are a long prompt's, its
values are not (the weights are random anyway), and a 254,064-token context costs two chunks' work, not the
prompt's. Prompts are random token ids (no prefix-cache hit), every answer runs its full length (`ignore_eos`),
nothing is detokenized (the wide model has no tokenizer). What each rank ran in each step is the census's
(TOOLKIT_CENSUS); this script writes the steps' shapes, in order, to the plan's `labels` file. Standard library and
the tree's vLLM only: it runs where the toolkit is not installed.
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

    def run(prompt_tokens: int, batch: int, max_tokens: int, expected: list[dict[str, Any]], skip: int = 0) -> None:
        nonlocal counter
        groups = []
        for _ in range(batch):
            prompt = [rng.randrange(16, plan["vocab"]) for _ in range(prompt_tokens)]
            engine.add_request(f"census-{counter}", {"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                                              temperature=0.0))
            groups.append(engine.scheduler[0].waiting[-1])
            counter += 1
        ran = 0
        while engine.has_unfinished_requests():
            engine.step()
            ran += 1
            if ran == 1 and skip:
                # the scheduler and the model runner take a prompt's computed tokens as the next chunk's context
                # (0.6.3's chunked prefill: `_get_num_new_tokens`, `_compute_lens`); after a first chunk computed
                # from the start (which a served path may need: the exact checkpoints carry its state), the next
                # chunk is the one after `skip` more
                for group in groups:
                    group.update_num_computed_tokens(skip)
        if ran != len(expected):
            raise SystemExit(f"census: {batch} request(s) of {prompt_tokens} prompt tokens and {max_tokens} answer "
                             f"tokens ran {ran} steps, not {len(expected)}: the plan's budget does not fit them")
        labels.extend(expected)
        skipped = f" ({skip} of them skipped after the first chunk)" if skip else ""
        print(f"[census] {batch} x {prompt_tokens} prompt tokens{skipped}, {max_tokens} answer token(s): {ran} "
              "step(s)", file=sys.stderr, flush=True)

    for tokens in plan["prefills"]:
        run(tokens, 1, 1, [{"decodes": [], "prefills": [tokens]}])
    prompt, steps = plan["decode_prompt"], plan["decode_steps"]
    for batch in plan["batches"]:
        run(prompt, batch, steps + 1, [{"decodes": [], "prefills": [prompt] * batch}] + [
            {"decodes": [prompt + 1 + i] * batch, "prefills": []} for i in range(steps)])
    chunk = plan["chunk"]
    # the scheduler reads its token budget at each step (`SchedulingBudget`): at the chunk's size, a context's
    # first chunk is that many tokens, not a whole budget's (the budget sized the engine's buffers at its start)
    engine.scheduler[0].scheduler_config.max_num_batched_tokens = chunk
    for context in plan["contexts"]:
        length = context + chunk
        run(length, 1, steps + 1, [{"decodes": [], "prefills": [chunk]},
                                   {"decodes": [], "prefills": [chunk], "depth": context},
                                   *({"decodes": [length + 1 + i], "prefills": [], "depth": context}
                                     for i in range(steps))], skip=context - chunk)
    with open(plan["labels"], "w", encoding="utf-8") as out:
        json.dump(labels, out)


if __name__ == "__main__":
    main(sys.argv[1])
