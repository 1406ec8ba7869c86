"""Run by the CPU runtime's Python with the patched vendor root and the patched transformers first on sys.path (see
test_preflight.py): the KV accounting through vLLM's own config and cache code, then the pinned adapter's hybrid
model over the caches vLLM's CacheEngine allocates, under each HYBRID_KV_ACCOUNTING value. Prints one JSON object.
"""

import atexit
import json
import os
import shutil
import sys
import tempfile
import types

import runtime_shims
import torch

REAL = {"hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "torch_dtype": "bfloat16"}
SMALL = {"hidden_size": 32, "num_hidden_layers": 40, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 64, "vocab_size": 64, **runtime_shims.SMALL_HYBRID, "torch_dtype": "float32"}
BLOCK = 16


def checkpoint(shape):
    """A composite Qwen3.6 config.json (the text model under text_config), as the served checkpoint's."""
    folder = tempfile.mkdtemp(prefix="kv-config-")
    atexit.register(shutil.rmtree, folder, True)  # this script made it; nothing of it outlives the run
    text = dict(shape, full_attention_interval=4, max_position_embeddings=4096)
    with open(os.path.join(folder, "config.json"), "w") as handle:
        json.dump({"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe",
                   "torch_dtype": shape["torch_dtype"], "text_config": text,
                   "vision_config": runtime_shims.vision_config(text["hidden_size"])}, handle)
    return folder


def configs(folder, dtype, tp=1):
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig

    model = ModelConfig(folder, folder, "auto", False, dtype, 0, max_model_len=4096, skip_tokenizer_init=True)
    return model, ParallelConfig(1, tp, False), CacheConfig(BLOCK, 0.9, 0, "auto")


def metadata(seq_lens, query_lens, tables, slots):
    from vllm.attention.backends.xformers import XFormersMetadata

    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    prefill = max(query_lens) > 1
    return XFormersMetadata(
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32), max_decode_seq_len=0 if prefill else max(seq_lens),
        block_tables=torch.tensor(tables, dtype=torch.int32), num_prefills=len(seq_lens) if prefill else 0,
        num_prefill_tokens=sum(query_lens) if prefill else 0, num_decode_tokens=0 if prefill else len(seq_lens),
        slot_mapping=torch.tensor(slots), max_prefill_seq_len=max(seq_lens) if prefill else 0, use_cuda_graph=False,
        seq_lens=list(seq_lens), seq_start_loc=starts,
        context_lens_tensor=torch.tensor([s - q for s, q in zip(seq_lens, query_lens, strict=True)],
                                         dtype=torch.int32),
        max_query_len=max(query_lens), max_decode_query_len=1, query_start_loc=starts)


def rows(indices):
    """What vLLM's LogitsProcessor reads of a SamplingMetadata: the rows to take logits of, and no per-request
    logits processors."""
    return types.SimpleNamespace(selected_token_indices=indices, seq_groups=[])


def layer_numbered(module):
    """The adapter's model module with its full-attention layers indexing the KV caches by layer number (as a model
    written for 40 caches would): its own text with that one line changed."""
    with open(module.__file__, encoding="utf-8") as handle:
        text = handle.read()
    anchor = "kv_cache = kv_caches[attn_idx]"
    assert text.count(anchor) == 1, "the adapter's Qwen3_5Model.forward changed"
    mutant = types.ModuleType(module.__name__ + "_layer_numbered")
    mutant.__file__ = module.__file__
    exec(compile(text.replace(anchor, "kv_cache = kv_caches[attn_idx + linear_idx]"), module.__file__, "exec"),
         mutant.__dict__)
    return mutant


def generate(model, kv_caches, steps=4):
    """Greedy prefill then decode of two prompts over non-contiguous blocks; tokens and the last logits."""
    tables = [[3, 0, 6], [5, 1, 2]]
    prompts = [[(7 * i + 3) % 64 for i in range(19)], [(5 * i + 1) % 64 for i in range(7)]]
    model.mamba_cache = None  # a fresh state slot per run
    requests = {"request_ids_to_seq_ids": {"a": [0], "b": [1]}, "finished_requests_ids": []}
    for cache in kv_caches:
        cache.zero_()

    def slot(seq, pos):
        return tables[seq][pos // BLOCK] * BLOCK + pos % BLOCK

    lens = [len(p) for p in prompts]
    ids = torch.tensor(prompts[0] + prompts[1])
    slots = [slot(s, p) for s in range(2) for p in range(lens[s])]
    positions = torch.tensor([p for s in range(2) for p in range(lens[s])])
    with torch.no_grad():
        hidden = model(ids, positions, kv_caches, metadata(lens, lens, tables, slots), **requests)
        logits = model.compute_logits(hidden, rows(torch.tensor([lens[0] - 1, sum(lens) - 1])))
        out = [logits.argmax(-1).tolist()]
        for _ in range(steps):
            positions = torch.tensor(lens)
            slots = [slot(s, lens[s]) for s in range(2)]
            lens = [n + 1 for n in lens]
            hidden = model(torch.tensor(out[-1]), positions, kv_caches, metadata(lens, [1, 1], tables, slots),
                           **requests)
            logits = model.compute_logits(hidden, rows(torch.arange(2)))
            out.append(logits.argmax(-1).tolist())
    return out, logits


def main():
    from vllm.config import DeviceConfig
    from vllm.model_executor.models import qwen3_5
    from vllm.worker import cache_engine

    runtime_shims.on_cpu()
    runtime_shims.distributed()  # the MoE block all-reduces its partial sums, as in a worker
    real, small = checkpoint(REAL), checkpoint(SMALL)
    results = {}
    runs = {}
    for mode in ("full_attention", "legacy40"):
        os.environ["HYBRID_KV_ACCOUNTING"] = mode
        model_config, parallel, cache = configs(real, "bfloat16", tp=4)
        entry = {"attention_layers": model_config.get_num_attention_layers(parallel),
                 "block_bytes": cache_engine.CacheEngine.get_cache_block_size(cache, model_config, parallel)}
        model_config, parallel, cache = configs(small, "float32")
        cache.num_gpu_blocks, cache.num_cpu_blocks = 8, 0
        engine = cache_engine.CacheEngine(cache, model_config, parallel, DeviceConfig("cpu"))
        entry["allocated_caches"] = len(engine.gpu_cache)
        model = runtime_shims.seeded(qwen3_5.Qwen3_5MoeForCausalLM(model_config.hf_config, cache))
        tokens, logits = generate(model, engine.gpu_cache)
        runs[mode] = (tokens, logits)
        entry["tokens"] = tokens
        entry["smallest_logit_spread"] = float((logits.max(-1).values - logits.min(-1).values).min())
        if mode == "full_attention":
            mutant = runtime_shims.seeded(layer_numbered(qwen3_5).Qwen3_5MoeForCausalLM(model_config.hf_config,
                                                                                     cache))
            try:
                generate(mutant, engine.gpu_cache)
                entry["mutant"] = "ran"
            except IndexError as exc:
                entry["mutant"] = f"IndexError: {exc}"
        results[mode] = entry
    results["max_abs_logit_diff"] = float((runs["full_attention"][1] - runs["legacy40"][1]).abs().max())
    json.dump(results, sys.__stdout__)


if __name__ == "__main__":
    sys.stdout = sys.stderr
    main()
