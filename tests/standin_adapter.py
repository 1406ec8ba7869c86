"""A stand-in for the public Qwen3.6 model adapter (`qwen3_6_scripts/` of wudixzy/competition@5a1c8c7).

The adapter is third-party code and never committed; the tests need one with its layout. This module writes
one into a git repository: the same file names, folders and destinations (../shared/ADAPTER.md section 1), the
same function and class names and signatures the recipe edits and dispatches into, and the anchors of each edit.
Where the recipe probes calls ADAPTER.md does not list (the full-attention class's projections, norms, rope and
attention; the shared expert; the decoder layer's norms), the stand-in has the call structure the adapter's public
history shows in versions before and after the pin. Its qwen3_5.py is written in the adapter's plain style
(per-expert loop, token-by-token recurrence) and imports only torch. Its nine whole-file replacements are derived
from the public vLLM 0.6.3 files (the vendor's true base: six of the nine real ones are byte-identical to them) with
the few changes listed in REPLACEMENTS; like the real adapter, some files are stored with CRLF line endings.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import git

SOURCE = '''\
"""Stand-in for the model adapter's qwen3_5.py (test fixture)."""

import collections

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)  # the adapter's is vLLM's init_logger; importing vllm here would tie the
                                      # adapter tests that import this module alone to a full vLLM install


def _l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _torch_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                                      use_qk_l2norm_in_kernel=False):
    q, k, v = query.float(), key.float(), value.float()
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    groups = v.shape[2] // k.shape[2]
    q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    q = q * q.shape[-1] ** -0.5
    batch, seq, heads, dk = k.shape
    state = torch.zeros(batch, heads, dk, v.shape[-1]) if initial_state is None else initial_state.float().clone()
    out = torch.zeros(batch, seq, heads, v.shape[-1])
    for t in range(seq):
        state = state * g[:, t].float().exp()[..., None, None]
        kt = k[:, t]
        u = beta[:, t].float()[..., None] * (v[:, t] - (state * kt[..., None]).sum(-2))
        state = state + kt[..., None] * u[..., None, :]
        out[:, t] = (state * q[:, t, :, :, None]).sum(-2)
    return out.to(value.dtype), (state if output_final_state else None)


def _torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                  output_final_state=False, use_qk_l2norm_in_kernel=False):
    # the stand-in computes the chunked form by the plain recurrence: the same numbers
    return _torch_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state, output_final_state,
                                             use_qk_l2norm_in_kernel)


class Qwen3_5RMSNormGated(torch.nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states, gate):
        dtype = hidden_states.dtype
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * x * F.silu(gate.float())).to(dtype)


class _Experts(torch.nn.Module):
    def __init__(self, num_experts, hidden, inter):
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.randn(num_experts, 2 * inter, hidden) / 4)
        self.w2_weight = torch.nn.Parameter(torch.randn(num_experts, hidden, inter) / 4)


class Qwen3_5MoeSparseBlock(torch.nn.Module):
    def __init__(self, num_experts=8, top_k=2, hidden=16, inter=6):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.experts = _Experts(num_experts, hidden, inter)
        self.gate = torch.nn.Linear(hidden, num_experts, bias=False)
        self.shared_expert_gate_up = torch.nn.Linear(hidden, 2 * inter, bias=False)
        self.shared_expert_down = torch.nn.Linear(inter, hidden, bias=False)
        self.shared_expert_gate = torch.nn.Linear(hidden, 1, bias=False)

    def forward(self, hidden_states):
        # as the adapter (5a1c8c7's separate router and shared-expert gate): the router, the routed experts
        # (partial sums), the shared expert with its sigmoid scalar gate, then one TP all-reduce
        from vllm.distributed import tensor_model_parallel_all_reduce

        router_logits = self.gate(hidden_states)
        routed_out = self._pure_pytorch_experts(hidden_states, router_logits)
        gate, up = self.shared_expert_gate_up(hidden_states).chunk(2, dim=-1)
        shared_out = self.shared_expert_down(F.silu(gate) * up)
        shared_out = shared_out * torch.sigmoid(self.shared_expert_gate(hidden_states))
        return tensor_model_parallel_all_reduce(routed_out + shared_out)  # vLLM's returns its input on one rank

    def _pure_pytorch_experts(self, hidden_states, router_logits):
        probs = torch.softmax(router_logits.float(), dim=-1)
        weights, selected = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        inter = self.experts.w2_weight.shape[-1]
        out = torch.zeros(hidden_states.shape[0], self.experts.w2_weight.shape[1])
        for e in range(self.num_experts):
            idx, slot = torch.where(selected == e)
            if idx.numel() == 0:
                continue
            gate_up = hidden_states[idx] @ self.experts.w13_weight[e].t()
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            out.index_add_(0, idx, (act @ self.experts.w2_weight[e].t()) * weights[idx, slot, None])
        return out.to(hidden_states.dtype)
'''


MODEL_CLASSES = '''

def _rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class _Norm(torch.nn.Module):
    """RMSNorm without weights; forward_cuda as the adapter calls its q/k norms (GemmaRMSNorm in vLLM)."""

    def forward(self, x, residual=None):
        return _rms(x) if residual is None else (_rms(x + residual), x + residual)

    def forward_cuda(self, x):
        return _rms(x)


class _Rotary(torch.nn.Module):
    """Rotary position embedding on the first half of each head, by absolute position (as vLLM's get_rope)."""

    def __init__(self, head_dim, base=10000.0):
        super().__init__()
        self.head_dim = head_dim
        self.inv_freq = 1.0 / base ** (torch.arange(0, head_dim // 2, 2).float() / (head_dim // 2))

    def _rotate(self, x, positions):
        tokens = x.shape[0]
        x = x.view(tokens, -1, self.head_dim)
        rot = self.head_dim // 2
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x1, x2, rest = x[..., :rot // 2], x[..., rot // 2:rot], x[..., rot:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1).reshape(tokens, -1)

    def forward(self, positions, q, k):
        return self._rotate(q, positions), self._rotate(k, positions)


class _PagedAttention(torch.nn.Module):
    """Causal attention over vLLM's paged KV cache, in its layout (key [blocks, kv_heads, head_dim/x, block, x],
    value [blocks, kv_heads, head_dim, block]), called as vLLM's Attention layer is: (q, k, v, kv_cache,
    attn_metadata)."""

    def __init__(self, heads, kv_heads, head_dim, block_size):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.block_size = heads, kv_heads, head_dim, block_size

    def forward(self, q, k, v, kv_cache, attn_metadata):
        tokens, kvh, dim, block_size = q.shape[0], self.kv_heads, self.head_dim, self.block_size
        q = q.view(tokens, self.heads, dim)
        k, v = k.view(tokens, kvh, dim), v.view(tokens, kvh, dim)
        blocks, pack = kv_cache.shape[1], 16 // kv_cache.element_size()
        key_cache = kv_cache[0].view(blocks, kvh, dim // pack, block_size, pack)
        value_cache = kv_cache[1].view(blocks, kvh, dim, block_size)
        slots = attn_metadata.slot_mapping.long()
        key_cache[slots // block_size, :, :, slots % block_size, :] = k.view(tokens, kvh, dim // pack, pack)
        value_cache[slots // block_size, :, :, slots % block_size] = v
        out, start = [], 0
        groups = self.heads // kvh
        for seq, seq_len in enumerate(attn_metadata.seq_lens):
            query_len = int(attn_metadata.query_start_loc[seq + 1] - attn_metadata.query_start_loc[seq])
            # as vLLM's paged prefix attention: the context from the cache (the block table may hold only the
            # cached blocks, on a prefix hit), the step's own tokens from this call's keys and values
            positions = torch.arange(seq_len - query_len)
            table = attn_metadata.block_tables[seq].long()
            phys, offset = table[positions // block_size], positions % block_size
            keys = torch.cat([key_cache[phys, :, :, offset, :].reshape(-1, kvh, dim), k[start:start + query_len]])
            values = torch.cat([value_cache[phys, :, :, offset].reshape(-1, kvh, dim), v[start:start + query_len]])
            keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
            query = q[start:start + query_len]
            scores = torch.einsum("qhd,khd->hqk", query, keys) * dim ** -0.5
            mask = torch.ones(query_len, seq_len, dtype=torch.bool).triu(seq_len - query_len + 1)
            weights = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
            out.append(torch.einsum("hqk,khd->qhd", weights, values).reshape(query_len, -1))
            start += query_len
        return torch.cat(out)


class Qwen3_5FullAttention(torch.nn.Module):
    """The full-attention layer with the adapter family's call structure: q/k/v projections, per-head q/k norms
    (forward_cuda), rotary embedding by position, vLLM-style attention over the paged cache, output projection;
    its cache is the one of the full-attention layer numbered attn_idx."""

    def __init__(self, hidden, heads, kv_heads, head_dim, attn_idx, block_size):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.attn_idx = heads, kv_heads, head_dim, attn_idx
        self.q_proj = torch.nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = torch.nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = torch.nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = torch.nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm, self.k_norm = _Norm(), _Norm()
        self.rotary_emb = _Rotary(head_dim)
        self.attn = _PagedAttention(heads, kv_heads, head_dim, block_size)

    def forward(self, positions, hidden_states, kv_cache, attn_metadata):
        tokens = hidden_states.shape[0]
        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        q = self.q_norm.forward_cuda(q.view(tokens, self.heads, self.head_dim)).view(tokens, -1)
        k = self.k_norm.forward_cuda(k.view(tokens, self.kv_heads, self.head_dim)).view(tokens, -1)
        q, k = self.rotary_emb(positions, q, k)
        attn_out = self.attn(q, k, v, kv_cache, attn_metadata)
        return self.o_proj(attn_out)


class GatedDeltaNet(torch.nn.Module):
    """The linear-attention layer, with the adapter's forward signature: a causal conv (kernel 4; its state is the
    last 3 inputs) then a gated recurrence whose state (decay near 1: it remembers far back, as GatedDeltaNet
    does) lives in the mamba cache slot of each sequence, never in the KV cache. Prefill and decode rows alike
    continue from the slot's state (a prefix hit's tokens are not fed again)."""

    def __init__(self, hidden, kernel=4):
        super().__init__()
        self.in_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.out_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.conv_weight = torch.nn.Parameter(torch.randn(kernel, hidden) / kernel)
        self.decay = torch.nn.Parameter(torch.rand(hidden) * 0.04 + 0.95)
        self.norm = Qwen3_5RMSNormGated(hidden)

    def forward(self, hidden_states, attn_metadata, conv_state, temporal_state):
        u, out = self.in_proj(hidden_states), []
        for seq in range(len(attn_metadata.seq_lens)):
            for t in range(int(attn_metadata.query_start_loc[seq]), int(attn_metadata.query_start_loc[seq + 1])):
                window = torch.cat([conv_state[seq], u[t:t + 1]])
                conv_state[seq] = window[1:]
                temporal_state[seq] = self.decay * temporal_state[seq] + (window * self.conv_weight).sum(0)
                out.append(temporal_state[seq].clone())
        # the gated norm on the recurrence's output, as the adapter calls it (self.norm(core_out, z))
        return self.out_proj(self.norm(torch.stack(out), hidden_states))


class Qwen3_5DecoderLayer(torch.nn.Module):
    """One layer as the adapter family writes it: input norm (fused with the residual after the first layer),
    full attention or GatedDeltaNet, post-attention norm, then the MoE block when the text config is the MoE one
    (the adapter picks it by text_config.model_type == 'qwen3_5_moe_text'); returns (hidden, residual)."""

    def __init__(self, text, layer_type, attn_idx, linear_idx, block_size):
        super().__init__()
        self.layer_type = layer_type
        hidden = text.hidden_size
        self.input_layernorm, self.post_attention_layernorm = _Norm(), _Norm()
        if layer_type == "full_attention":
            self.self_attn = Qwen3_5FullAttention(hidden, text.num_attention_heads, text.num_key_value_heads,
                                                  text.head_dim, attn_idx, block_size)
        else:
            self.linear_attn = GatedDeltaNet(hidden)
            self.linear_idx = linear_idx
        moe = getattr(text, "model_type", "") == "qwen3_5_moe_text"
        self.mlp = Qwen3_5MoeSparseBlock(hidden=hidden) if moe else None

    def forward(self, positions, hidden_states, kv_caches, attn_metadata, residual, conv_state, temporal_state):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if self.layer_type == "full_attention":
            hidden_states = self.self_attn(positions, hidden_states, kv_caches[self.self_attn.attn_idx],
                                           attn_metadata)
        else:
            hidden_states = self.linear_attn(hidden_states, attn_metadata, conv_state[self.linear_idx],
                                             temporal_state[self.linear_idx])
        if self.mlp is not None:
            hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
            hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


class Qwen3_5ForCausalLM(torch.nn.Module):
    """Dense Qwen3.5/3.6 with the adapter's forward structure: its linear-attention layers read their state from
    the mamba cache (vLLM's MambaCacheManager, the adapter's mamba_cache.py), its full-attention layers
    kv_caches[attn_idx], attn_idx counting the full-attention layers only (so one KV cache per full-attention layer
    is all it reads).

    Prefix hits, as the pinned adapter (5a1c8c7) handles them: after a prefill step whose batch holds exactly one
    sequence, the states after the step's last token are kept (on CPU, an LRU of 16) under the tuple of the physical
    ids of all complete blocks so far ((context_len + query_len) // block_size); at a prefill step with one sequence
    and context_len > 0, the tuple of the first context_len // block_size ids is looked up and, when present, copied
    into the sequence's slot; otherwise the slot keeps what it has (zeroed when the request took it). Written inline
    in forward, in the statements the adapter's own forward has (`_is_single_seq_prefill`, `self._gdn_prefix_cache`):
    the flagship's transforms that take it out anchor on them."""

    has_inner_state = True

    def __init__(self, config, cache_config=None, quant_config=None, scheduler_config=None, **kwargs):
        super().__init__()
        text = getattr(config, "text_config", config)
        hidden = text.hidden_size
        self.block_size = cache_config.block_size if cache_config is not None else 16
        self.max_batch = scheduler_config.max_num_seqs if scheduler_config is not None else 8
        self.embed_tokens = torch.nn.Embedding(text.vocab_size, hidden)
        self.layers = torch.nn.ModuleList()
        attn_idx = linear_idx = 0
        for layer_type in text.layer_types:
            self.layers.append(Qwen3_5DecoderLayer(text, layer_type, attn_idx, linear_idx, self.block_size))
            attn_idx += layer_type == "full_attention"
            linear_idx += layer_type != "full_attention"
        self.num_linear_layers = linear_idx
        self.lm_head = torch.nn.Linear(hidden, text.vocab_size, bias=False)
        self.mamba_cache = None
        self._gdn_prefix_cache = collections.OrderedDict()
        self._gdn_prefix_cache_max = 16
        self._block_size = self.block_size

    def forward(self, input_ids, positions, kv_caches, attn_metadata, intermediate_tensors=None, **kwargs):
        from vllm.model_executor.models.mamba_cache import MambaCacheManager

        hidden = self.embed_tokens.embedding_dim
        if self.mamba_cache is None:
            self.mamba_cache = MambaCacheManager(torch.float32, self.num_linear_layers, self.max_batch,
                                                 (3, hidden), (hidden,))
        conv_states, temporal_states = self.mamba_cache.current_run_tensors(input_ids, attn_metadata, **kwargs)
        # the pinned adapter's block-id restore and save, inline in its forward as there (same statements)
        _is_single_seq_prefill = (
            attn_metadata is not None and attn_metadata.num_prefill_tokens > 0 and conv_states.shape[1] == 1
            and getattr(attn_metadata, 'context_lens_tensor', None) is not None
            and getattr(attn_metadata, 'block_tables', None) is not None and attn_metadata.block_tables.numel() > 0
        )
        if _is_single_seq_prefill:
            context_len = int(attn_metadata.context_lens_tensor[0].item())
            if context_len > 0:
                num_prefix_blocks = context_len // self._block_size
                if num_prefix_blocks > 0 and attn_metadata.block_tables.shape[1] >= num_prefix_blocks:
                    lookup_key = tuple(attn_metadata.block_tables[0, :num_prefix_blocks].cpu().tolist())
                    if lookup_key in self._gdn_prefix_cache:
                        saved_conv, saved_temporal = self._gdn_prefix_cache[lookup_key]
                        conv_states[:, 0].copy_(saved_conv.to(conv_states.device), non_blocking=True)
                        temporal_states[:, 0].copy_(saved_temporal.to(temporal_states.device), non_blocking=True)
                        self._gdn_prefix_cache.move_to_end(lookup_key)
                        logger.debug("GDN prefix cache hit: prefix_len=%d blocks=%d", context_len, num_prefix_blocks)
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(positions, h, kv_caches, attn_metadata, residual, conv_states, temporal_states)
        hidden_states = _rms(h + residual)
        if _is_single_seq_prefill:
            context_len = int(attn_metadata.context_lens_tensor[0].item())
            query_len = attn_metadata.num_prefill_tokens
            total_processed = context_len + query_len
            num_complete_blocks = total_processed // self._block_size
            if num_complete_blocks > 0 and attn_metadata.block_tables.shape[1] >= num_complete_blocks:
                save_key = tuple(attn_metadata.block_tables[0, :num_complete_blocks].cpu().tolist())
                if save_key in self._gdn_prefix_cache:
                    self._gdn_prefix_cache.move_to_end(save_key)
                self._gdn_prefix_cache[save_key] = (
                    conv_states[:, 0].cpu().clone(),
                    temporal_states[:, 0].cpu().clone(),
                )
                while len(self._gdn_prefix_cache) > self._gdn_prefix_cache_max:
                    self._gdn_prefix_cache.popitem(last=False)
        return hidden_states

    def compute_logits(self, hidden_states, sampling_metadata=None):
        if sampling_metadata is not None:
            hidden_states = hidden_states.index_select(0, sampling_metadata.selected_token_indices)
        return self.lm_head(hidden_states)

    def sample(self, logits, sampling_metadata):
        from vllm.model_executor.layers.sampler import Sampler

        return Sampler()(logits, sampling_metadata)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """MoE Qwen3.5/3.6: what the served checkpoint's config.json declares (its MoE block is the one above)."""
'''

BI100_ENV = '''"""Strict env parsing (stand-in)."""
import os

_TRUE = ("1", "true", "TRUE", "yes", "on")
_FALSE = ("0", "false", "FALSE", "no", "off")


def env_bool(name, default):
    raw = os.environ.get(name)
    if raw is None:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean")


def env_int(name, default, minimum, maximum):
    value = int(os.environ.get(name, default))
    if not minimum <= value <= maximum:
        raise ValueError(f"{name}={value} is outside [{minimum}, {maximum}]")
    return value
'''

BI100_PROFILE = '''"""BI100_PROFILE timers (stand-in)."""
import contextlib
import os
import time


@contextlib.contextmanager
def bi100_timer(name):
    if os.environ.get("BI100_PROFILE") != "1":
        yield
        return
    start = time.perf_counter()
    yield
    print(f"[BI100_PROFILE] {name} {(time.perf_counter() - start) * 1e3:.3f} ms")
'''

TOOL_PARSER = '''"""qwen3_coder tool parser (stand-in: registers under the adapter's name)."""
from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager


@ToolParserManager.register_module("qwen3_coder")
class Qwen3CoderToolParser(ToolParser):
    pass
'''

REASONING = {
    "__init__.py": '''from vllm.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager

ReasoningParserManager.register_lazy("qwen3", "vllm.reasoning.qwen3_reasoning_parser", "Qwen3ReasoningParser")

__all__ = ["ReasoningParser", "ReasoningParserManager"]
''',
    "abs_reasoning_parsers.py": '''import importlib


class ReasoningParser:
    def __init__(self, tokenizer, **kwargs):
        self.model_tokenizer = tokenizer


class ReasoningParserManager:
    _parsers = {}
    _lazy = {}

    @classmethod
    def register_module(cls, name):
        def register(parser):
            cls._parsers[name] = parser
            return parser
        return register

    @classmethod
    def register_lazy(cls, name, module, class_name):
        cls._lazy[name] = (module, class_name)

    @classmethod
    def get_reasoning_parser(cls, name):
        if name not in cls._parsers and name in cls._lazy:
            module, class_name = cls._lazy[name]
            cls._parsers[name] = getattr(importlib.import_module(module), class_name)
        return cls._parsers[name]

    @classmethod
    def list_registered(cls):
        return sorted(set(cls._parsers) | set(cls._lazy))
''',
    "qwen3_reasoning_parser.py": '''from vllm.reasoning.abs_reasoning_parsers import (ReasoningParser,
                                                  ReasoningParserManager)


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    start_token, end_token = "<think>", "</think>"
''',
}


CONFIG_TEMPLATE = '''"""Stand-in for the adapter's {module} config classes (adapted from transformers 5.2 like the real
ones: PretrainedConfig imported as PreTrainedConfig, a local layer_type_validation, a text and a vision config under
a composite one; config only, no modeling code)."""

from transformers.configuration_utils import PretrainedConfig as PreTrainedConfig


def layer_type_validation(layer_types, num_hidden_layers=None):
    if not all(t in ("full_attention", "linear_attention") for t in layer_types):
        raise ValueError(f"unknown layer type in {{layer_types}}")
    if num_hidden_layers is not None and len(layer_types) != num_hidden_layers:
        raise ValueError("layer_types and num_hidden_layers disagree")


class {prefix}TextConfig(PreTrainedConfig):
    model_type = "{model_type}_text"
    base_config_key = "text_config"

    def __init__(self, vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                 num_key_value_heads=2, head_dim=256, max_position_embeddings=262144, rms_norm_eps=1e-6,
                 layer_types=None, full_attention_interval=4, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.layer_types = layer_types
        if self.layer_types is None:
            self.layer_types = ["linear_attention" if bool((i + 1) % full_attention_interval) else "full_attention"
                                for i in range(self.num_hidden_layers)]
        layer_type_validation(self.layer_types, self.num_hidden_layers)
        super().__init__(**kwargs)


class {prefix}VisionConfig(PreTrainedConfig):
    model_type = "{vision_type}"
    base_config_key = "vision_config"


class {prefix}Config(PreTrainedConfig):
    model_type = "{model_type}"
    sub_configs = {{"vision_config": {prefix}VisionConfig, "text_config": {prefix}TextConfig}}

    def __init__(self, text_config=None, vision_config=None, **kwargs):
        self.text_config = {prefix}TextConfig(**(text_config or {{}})) if not isinstance(
            text_config, PreTrainedConfig) else text_config
        self.vision_config = {prefix}VisionConfig(**(vision_config or {{}})) if not isinstance(
            vision_config, PreTrainedConfig) else vision_config
        super().__init__(**kwargs)


__all__ = {exported}
'''


def _config(module: str, prefix: str, model_type: str, vision_type: str, exported: list[str]) -> dict[str, str]:
    return {
        "__init__.py": f"from .configuration_{module} import *\n",
        f"configuration_{module}.py": CONFIG_TEMPLATE.format(module=module, prefix=prefix, model_type=model_type,
                                                             vision_type=vision_type, exported=exported),
    }


# the MoE package exports no vision config, and its vision config's model_type is the composite's (ADAPTER.md 4)
CONFIGS = {"qwen3_5": _config("qwen3_5", "Qwen3_5", "qwen3_5", "qwen3_5_vision",
                              ["Qwen3_5Config", "Qwen3_5TextConfig", "Qwen3_5VisionConfig"]),
           "qwen3_5_moe": _config("qwen3_5_moe", "Qwen3_5Moe", "qwen3_5_moe", "qwen3_5_moe",
                                  ["Qwen3_5MoeConfig", "Qwen3_5MoeTextConfig"])}

# adapter file -> (vendor file it replaces, what the stand-in changes in the public file)
REPLACEMENTS = {
    "paged_attn.py": ("vllm/attention/ops/paged_attn.py", "the V1/V2 choice moved into a function that forces V1"),
    "mamba_cache.py": ("vllm/model_executor/models/mamba_cache.py", "a request's state slot zeroed when it takes it"),
    "sequence.py": ("vllm/sequence.py", "RequestMetrics.num_cached_tokens"),
    "scheduler.py": ("vllm/core/scheduler.py", "num_cached_tokens recorded as the block manager's whole hit"),
    "protocol.py": ("vllm/entrypoints/openai/protocol.py", "a comment; CRLF line endings"),
    "cli_args.py": ("vllm/entrypoints/openai/cli_args.py", "--reasoning-parser after --tool-parser-plugin"),
    "serving_chat.py": ("vllm/entrypoints/openai/serving_chat.py", "a comment"),
    "api_server.py": ("vllm/entrypoints/openai/api_server.py", "a comment"),
    "chat_utils.py": ("vllm/entrypoints/chat_utils.py", "a comment"),
}
CRLF = {"protocol.py", "bi100_env.py"}

V1_CHOICE = re.compile(r"use_v1 = \(max_seq_len <= 8192\n\s+"
                       r"and \(max_num_partitions == 1 or num_seqs \* num_heads > 512\)\)")
V1_FUNCTION = '''    @staticmethod
    def _should_use_paged_attention_v1(max_seq_len, max_num_partitions, num_seqs, num_heads):
        # stand-in: the adapter keeps the vendor's forced V1 here
        return True

    @staticmethod
    def forward_decode('''
REASONING_FLAG = '''    parser.add_argument(
        "--reasoning-parser",
        type=str,
        default=None,
        help="The reasoning parser (stand-in adapter).")
    parser.add_argument(
        "--tool-parser-plugin",'''


# (anchor in the public file, what the stand-in adds after it), as the adapter's replacements do
EDITS = {
    "mamba_cache.py": [("""            self.mamba_cache_indices_mapping[cur_rid] = {
                seq_id: destination_index
            }
""", """            for cache_t in self.mamba_cache:
                cache_t[:, destination_index].zero_()
""")],
    "sequence.py": [("""    model_execute_time: Optional[float] = None
""", """    num_cached_tokens: Optional[int] = None
""")],
    "scheduler.py": [("""                common_computed_block_nums = (
                    self.block_manager.get_common_computed_block_ids(
                        seq_group.get_seqs(status=SequenceStatus.RUNNING)))
""", """                if seq_group.is_prefill():
                    seq_group.metrics.num_cached_tokens = (
                        len(common_computed_block_nums) * self.block_manager.block_size)
""")],
}


def replacement(name: str, vendor_text: str) -> str:
    if name == "paged_attn.py":
        text, n = V1_CHOICE.subn("use_v1 = PagedAttention._should_use_paged_attention_v1(\n"
                                 "            max_seq_len, max_num_partitions, num_seqs, num_heads)", vendor_text)
        text = text.replace("    @staticmethod\n    def forward_decode(", V1_FUNCTION, 1)
        assert n == 1 and V1_FUNCTION in text, "the public paged_attn.py changed"
        return text
    if name in EDITS:
        text = vendor_text
        for anchor, addition in EDITS[name]:
            assert text.count(anchor) == 1, f"the public {name} changed"
            text = text.replace(anchor, anchor + addition)
        return text + f"\n# stand-in adapter: replacement of the vendor's {name}\n"
    if name == "cli_args.py":
        anchor = '    parser.add_argument(\n        "--tool-parser-plugin",'
        assert anchor in vendor_text, "the public cli_args.py changed"
        return vendor_text.replace(anchor, REASONING_FLAG, 1)
    return vendor_text + f"\n# stand-in adapter: replacement of the vendor's {name}\n"


def lay_out(folder: Path, vllm_reference: Path) -> None:
    """The adapter folder (qwen3_6_scripts/) with every file the flagship recipe uses, and some it does not."""
    files: dict[str, str] = {
        "qwen3_5.py": SOURCE + MODEL_CLASSES,
        "bi100_env.py": BI100_ENV,
        "bi100_profile.py": BI100_PROFILE,
        "qwen3coder_tool_parser.py": TOOL_PARSER,
        "patch_ops.sh": "# the adapter's own script: not used by the recipe\nexit 1\n",
        **{f"reasoning/{k}": v for k, v in REASONING.items()},
        **{f"{pkg}/{k}": v for pkg, items in CONFIGS.items() for k, v in items.items()},
    }
    for name, (vendor, _) in REPLACEMENTS.items():
        files[name] = replacement(name, (vllm_reference / vendor).read_text(encoding="utf-8"))
    for rel, text in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        data = text.encode()
        path.write_bytes(data.replace(b"\n", b"\r\n") if rel in CRLF else data)
    wheels = folder / "wheels"
    wheels.mkdir(exist_ok=True)
    # the snapshot carries a large wheel the recipe never uses: bundling must leave it out
    (wheels / "transformers-4.55.3-py3-none-any.whl").write_bytes(os.urandom(1 << 20))


def make_repo(work: Path, vllm_reference: Path, subdir: str = "qwen3_6_scripts") -> tuple[Path, str]:
    """A bare clone holding the stand-in adapter (a work tree is never needed); returns (clone, commit)."""
    source = work / "adapter-work"
    repo = git.Repo.init(source)
    lay_out(source / subdir, vllm_reference)
    (source / "README.md").write_text("stand-in adapter\n")
    repo.git.add("--all")
    actor = git.Actor("t", "t@t")
    commit = repo.index.commit("stand-in adapter", author=actor, committer=actor).hexsha
    (source / subdir / "qwen3_5.py").write_text("raise RuntimeError('uncommitted edit')\n")  # must never leak
    bare = work / "adapter.git"
    git.Repo.clone_from(str(source), str(bare), bare=True)
    return bare, commit


def add_commit(bare: Path, rel: str, text: str, message: str, subdir: str = "qwen3_6_scripts") -> str:
    """A later commit of the stand-in (pushed to the bare clone) with one file changed; returns the commit."""
    work = bare.parent / "adapter-work"
    repo = git.Repo(work)
    repo.git.checkout("--", ".")
    (work / subdir / rel).write_text(text)
    repo.git.add("--all")
    actor = git.Actor("t", "t@t")
    commit = repo.index.commit(message, author=actor, committer=actor).hexsha
    repo.git.push(str(bare), "HEAD:refs/heads/later")
    return commit
