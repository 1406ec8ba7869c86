"""vLLM's own LLMEngine on the vendor's GPU path on CPU tensors (toolkit_cpu_device), over a patched CoreX-like
tree, with a tiny checkpoint: run by the CPU runtime's Python (see test_generate.py). Prints one JSON object, on
the line that starts with RESULT (vLLM logs to stdout too).

argv: one JSON object:
- model, tp, dtype, prefix_caching, budget (max_num_batched_tokens: below a prompt's length, the prefill is chunked),
  max_tokens, prompts (lists of token ids);
- every prompt is sent at once (several requests in one step), then the prompts of `later` (each sharing a prefix
  with an earlier one) when the first are done; greedy, `max_tokens` each, with the chosen token's logprob;
- the engine's KV cache is sized by the vendor's own profile run against the emulated memory;
- oracle: then a second engine recomputes every generated token: prefix caching off, unchunked, each prompt plus
  the tokens generated before it sent alone for one token (its KV cache `blocks` long: the first engine's is still
  in this process's peak), and (unless `reference` is false: the image's transformers has no class for the
  model) transformers' own forward of the checkpoint gives the same prompts' next tokens;
- mutant: a CPU reference made wrong on purpose (MUTANTS), replaced in the registry before the engine starts;
- runs (optional): {name: settings}: each a run of the settings above over these, one after another in this
  process (starting the engine is most of a run: importing vLLM, the vendor's model inspection in a child Python);
  then the RESULT is {name: result}.
"""

import json
import os
import sys


def _mutants():
    import toolkit_references
    import torch
    from toolkit_references import ixformer

    def transposed_kv(key, value, key_cache, value_cache, slot_mapping):
        # the key written [head_size // x, x] transposed within each head: a wrong layout, same shape
        x = key_cache.shape[-1]
        tokens, kv_heads, head_size = key.shape
        wrong = key.reshape(tokens, kv_heads, x, head_size // x).transpose(-1, -2).reshape(tokens, kv_heads, -1)
        return ixformer.vllm_cache_ops_reshape_and_cache(wrong.contiguous(), value, key_cache, value_cache,
                                                         slot_mapping)

    def mask_off_by_one(query, key, value, attn_bias=None, p=0.0, scale=None, op=None):
        # each token also sees the next one
        heads, kv_heads = query.shape[2], key.shape[2]
        q = query[0].float().transpose(0, 1)
        k = key[0].float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        v = value[0].float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        pieces, start = [], 0
        for n in attn_bias.q_seqlens:
            mask = torch.ones(n, n, dtype=torch.bool).tril(1)
            pieces.append(torch.nn.functional.scaled_dot_product_attention(
                q[:, start:start + n], k[:, start:start + n], v[:, start:start + n], attn_mask=mask, scale=scale))
            start += n
        return torch.cat(pieces, 1).transpose(0, 1).unsqueeze(0).to(query.dtype)

    def head_mapping_ignored(output, query, key_cache, value_cache, head_mapping, *args, **kwargs):
        kv_heads = key_cache.shape[1]
        wrong = torch.arange(query.shape[1], dtype=head_mapping.dtype) % kv_heads
        return ixformer.vllm_single_query_cached_kv_attention(output, query, key_cache, value_cache, wrong, *args,
                                                              **kwargs)

    functions = "ixformer.functions"
    return toolkit_references.REFERENCES, {
        "transposed-kv-layout": (f"{functions}.vllm_cache_ops_reshape_and_cache", transposed_kv),
        "causal-mask-off-by-one": ("ixformer.contrib.xformers.ops.memory_efficient_attention_forward",
                                   mask_off_by_one),
        "head-mapping-ignored": (f"{functions}.vllm_single_query_cached_kv_attention", head_mapping_ignored),
    }


def _engine(run, prefix_caching, budget, blocks=None):
    from vllm import EngineArgs, LLMEngine

    with open(os.path.join(run["model"], "config.json")) as handle:
        multimodal = "vision_config" in json.load(handle)
    # prompts are text here: a model with a vision tower (the adapter's since 2f7d5f5) is started with no image per
    # prompt, or its profile run would place a max-size image (1,282 tokens) in budgets of 32; the rehearsal starts
    # it with the served argv's image budget
    images = {"limit_mm_per_prompt": {"image": 0}} if multimodal else {}
    args = EngineArgs(model=run["model"], tensor_parallel_size=run["tp"], dtype=run["dtype"], max_model_len=512,
                      enforce_eager=True, block_size=16, enable_prefix_caching=prefix_caching,
                      enable_chunked_prefill=budget < 512, max_num_batched_tokens=budget, max_num_seqs=4,
                      gpu_memory_utilization=0.9, seed=0, swap_space=0, num_gpu_blocks_override=blocks, **images)
    return LLMEngine.from_engine_args(args)


def _transformers(run, prompts):
    """The same checkpoint through transformers' own forward, float32: each prompt's greedy next token and its
    logprob, computed by none of the vendor's code and none of the CPU references."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run["model"], torch_dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for name, prompt in prompts.items():
            logprobs = model(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
            token = int(logprobs.argmax())
            out[name] = {"tokens": [token], "logprobs": [float(logprobs[token])]}
    return out


def _drain(engine, outputs):
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                completion = out.outputs[0]
                outputs[out.request_id] = {
                    "tokens": list(completion.token_ids),
                    "logprobs": [step[token].logprob for step, token in zip(completion.logprobs,
                                                                             completion.token_ids, strict=True)]}


def _send(engine, name, prompt, max_tokens):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine.add_request(name, TokensPrompt(prompt_token_ids=prompt),
                       SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True))


def main():
    request = json.loads(sys.argv[1])
    runs = request.pop("runs", None)
    if runs is None:
        result = generate(request)
    else:
        result = {name: generate({**request, **settings}) for name, settings in runs.items()}
    print("RESULT " + json.dumps(result), flush=True)


def generate(run):
    if not run.get("mutant"):
        return _generate(run)
    registry, mutants = _mutants()
    name, function = mutants[run["mutant"]]
    kept, registry[name] = registry[name], function
    try:
        return _generate(run)
    finally:
        registry[name] = kept


def _generate(run):
    outputs, oracle, reference = {}, {}, {}
    engine = _engine(run, run["prefix_caching"], run["budget"])  # sized by the vendor's profile run
    cache = {"num_gpu_blocks": engine.cache_config.num_gpu_blocks,
             "block_bytes": engine.model_executor.driver_worker.get_cache_block_size_bytes()}
    for index, prompt in enumerate(run["prompts"]):
        _send(engine, str(index), prompt, run["max_tokens"])
    _drain(engine, outputs)
    for index, prompt in enumerate(run.get("later", [])):
        _send(engine, f"later{index}", prompt, run["max_tokens"])
    _drain(engine, outputs)
    from vllm.utils import Device

    block_manager = engine.scheduler[0].block_manager
    hit_rate = block_manager.get_prefix_cache_hit_rate(Device.GPU) if run["prefix_caching"] else None
    if run.get("oracle"):
        # a second engine in this process (the parallel groups are kept): prefix caching off, no chunking, each
        # prompt plus the tokens generated so far sent alone for one token
        del engine  # its KV cache stays in this process's peak: the recompute's cache is given its size
        engine = _engine(run, prefix_caching=False, budget=512, blocks=run["blocks"])
        prompts = dict(enumerate(run["prompts"])) | {f"later{i}": p for i, p in enumerate(run.get("later", []))}
        recompute = {}
        for name, prompt in prompts.items():
            for step, _ in enumerate(outputs[str(name)]["tokens"]):
                recompute[f"{name}@{step}"] = prompt + outputs[str(name)]["tokens"][:step]
                _send(engine, f"{name}@{step}", recompute[f"{name}@{step}"], 1)
                _drain(engine, oracle)
        if run.get("reference", True):  # a model transformers has a class for
            reference = _transformers(run, recompute)
    return {"outputs": outputs, "oracle": oracle, "reference": reference, "prefix_hit_rate": hit_rate,
            "cache": cache}


if __name__ == "__main__":
    main()
