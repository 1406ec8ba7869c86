"""A stand-in for the public Qwen3.6 model adapter (`qwen3_6_scripts/` of wudixzy/competition@5a1c8c7).

The adapter is third-party code and never committed; the tests need one with its layout. This module writes
one into a git repository: the same file names, folders and destinations (../shared/ADAPTER.md section 1), the
same function and class names and signatures the recipe edits and dispatches into, and the anchors of each edit.
Where the recipe probes calls ADAPTER.md does not list (the full-attention class's projections, norms, rope and
attention; the shared expert; the decoder layer's norms), the stand-in has the call structure the adapter's public
history shows in versions before and after the pin. Its qwen3_5.py is written in the adapter's plain style
(per-expert loop, per-sequence rule) and imports only torch at module level; its model classes are built from
vLLM's layers (parallel linears, the vocabulary embedding and LM head, get_rope, Attention over the paged cache),
so the vendor's ops, attention backend and TP all-reduce run under it, and its load_weights takes the published
checkpoint's names by the pinned loader's rules (ADAPTER.md 4b), a name it does not know skipped silently as
there. Its nine whole-file replacements are derived from the public vLLM 0.6.3 files (the vendor's true base: six
of the nine real ones are byte-identical to them) with the few changes listed in REPLACEMENTS; paged_attn.py also
carries the image's own edit of its decode call (the adapter's file was made from the image's, and ixformer's op
takes the shorter argument list); like the real adapter, some files are stored with CRLF line endings.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import git

from toolkit.corexlike import VENDOR_EDITS

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


def _tp():
    """This rank and the tensor-parallel size; (0, 1) where vLLM's groups are not set up (the module alone)."""
    try:
        from vllm.distributed import parallel_state
    except ImportError:
        return 0, 1
    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _sharded(param, dim, pieces=1):
    """Give param a weight_loader taking this rank's slice of a checkpoint tensor along dim (dim None: all of it).
    pieces: an int n > 1, the parameter stacks n checkpoint tensors of one size along dim and shard says which one;
    a list, the global sizes of the parts of one checkpoint tensor that shard each on their own (a fused q, k, v:
    this rank holds its slice of each, in order)."""

    def load(param, loaded, shard=0):
        rank, size = _tp()
        target = param.data
        if dim is not None:
            parts = loaded.split(pieces, dim) if isinstance(pieces, list) else [loaded]
            loaded = torch.cat([p.narrow(dim, rank * p.shape[dim] // size, p.shape[dim] // size) for p in parts], dim)
            if not isinstance(pieces, list):
                part = target.shape[dim] // pieces
                target = target.narrow(dim, shard * part, part)
        target.copy_(loaded)

    param.weight_loader = load
    return param


class _Experts(torch.nn.Module):
    """The routed experts' storage (the adapter keeps vLLM's FusedMoE for storage and loading only): w13 (experts,
    2 * intermediate / TP, hidden), gate rows then up rows; w2 (experts, hidden, intermediate / TP)."""

    def __init__(self, num_experts, hidden, inter):
        super().__init__()
        local = inter // _tp()[1]
        self.w13_weight = torch.nn.Parameter(torch.randn(num_experts, 2 * local, hidden) / 4)
        self.w2_weight = torch.nn.Parameter(torch.randn(num_experts, hidden, local) / 4)
        self.w13_weight.weight_loader = self.w2_weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id, expert_id):
        rank, size = _tp()
        if shard_id == "w2":  # (hidden, intermediate): this rank's columns
            part = loaded.shape[1] // size
            param.data[expert_id].copy_(loaded.narrow(1, rank * part, part))
            return
        part = loaded.shape[0] // size
        half = param.shape[1] // 2
        param.data[expert_id, (shard_id == "w3") * half:][:half].copy_(loaded.narrow(0, rank * part, part))


class Qwen3_5MoeSparseBlock(torch.nn.Module):
    def __init__(self, num_experts=8, top_k=2, hidden=16, inter=6, shared_inter=None):
        super().__init__()
        shared_inter = shared_inter or inter
        local = shared_inter // _tp()[1]
        self.num_experts = num_experts
        self.top_k = top_k
        self.experts = _Experts(num_experts, hidden, inter)
        self.gate = torch.nn.Linear(hidden, num_experts, bias=False)
        self.shared_expert_gate_up = torch.nn.Linear(hidden, 2 * local, bias=False)
        _sharded(self.shared_expert_gate_up.weight, 0, pieces=2)
        self.shared_expert_down = torch.nn.Linear(local, hidden, bias=False)
        _sharded(self.shared_expert_down.weight, 1)
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

def _rms(x, weight, eps=1e-6):
    """Zero-centred RMSNorm (Qwen3.5's): in fp32, times (1 + weight), cast back."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


class _Norm(torch.nn.Module):
    """The zero-centred RMSNorm, fused with the residual when given one; forward_cuda as the adapter calls its
    per-head q/k norms."""

    def __init__(self, size):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(size))

    def forward(self, x, residual=None):
        if residual is None:
            return _rms(x, self.weight)
        x = x + residual
        return _rms(x, self.weight), x

    def forward_cuda(self, x):
        return _rms(x, self.weight)


class Qwen3_5FullAttention(torch.nn.Module):
    """The full-attention layer with the adapter family's call structure: q (with its per-head output gate), k and v
    projections, per-head q/k norms (forward_cuda), partial rotary embedding (vLLM's get_rope, the first quarter of
    each head), vLLM's Attention layer over the paged KV cache (the backend the vendor's selector picks), the
    output gated by sigmoid, the output projection (a TP all-reduce). Heads are split over the TP ranks; its cache
    is the one of the full-attention layer numbered attn_idx."""

    def __init__(self, text, attn_idx, cache_config=None):
        super().__init__()
        from vllm.attention import Attention
        from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
        from vllm.model_executor.layers.rotary_embedding import get_rope

        size = _tp()[1]
        hidden, head_dim = text.hidden_size, text.head_dim
        self.heads, self.kv_heads = text.num_attention_heads // size, max(1, text.num_key_value_heads // size)
        self.head_dim, self.attn_idx = head_dim, attn_idx
        self.q_proj = ColumnParallelLinear(hidden, text.num_attention_heads * head_dim * 2, bias=False)
        self.k_proj = ColumnParallelLinear(hidden, text.num_key_value_heads * head_dim, bias=False)
        self.v_proj = ColumnParallelLinear(hidden, text.num_key_value_heads * head_dim, bias=False)
        self.o_proj = RowParallelLinear(text.num_attention_heads * head_dim, hidden, bias=False)
        self.q_norm, self.k_norm = _Norm(head_dim), _Norm(head_dim)
        rotary_dim = int(head_dim * getattr(text, "partial_rotary_factor", 0.25))
        self.rotary_emb = get_rope(head_dim, rotary_dim=rotary_dim, max_position=text.max_position_embeddings,
                                   base=getattr(text, "rope_theta", 10000000.0), is_neox_style=True)
        self.attn = Attention(self.heads, head_dim, head_dim ** -0.5, num_kv_heads=self.kv_heads,
                              cache_config=cache_config)

    def forward(self, positions, hidden_states, kv_cache, attn_metadata):
        tokens = hidden_states.shape[0]
        q, _ = self.q_proj(hidden_states)
        k, _ = self.k_proj(hidden_states)
        v, _ = self.v_proj(hidden_states)
        q, gate = q.view(tokens, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm.forward_cuda(q).reshape(tokens, -1)
        k = self.k_norm.forward_cuda(k.view(tokens, self.kv_heads, self.head_dim)).reshape(tokens, -1)
        q, k = self.rotary_emb(positions, q, k)
        attn_out = self.attn(q, k, v, kv_cache, attn_metadata)
        attn_out = attn_out * torch.sigmoid(gate.reshape(tokens, -1))
        out, _ = self.o_proj(attn_out)
        return out


class GatedDeltaNet(torch.nn.Module):
    """The linear-attention layer as Qwen3.5 computes it (../shared/DESIGN.md section 5), with the adapter's forward
    signature and Qwen3.5's checkpoint projections: in_proj_qkv (all q, then all k, then all v: each shards over the
    TP ranks on its own), in_proj_z, in_proj_b, in_proj_a; a causal depthwise conv (kernel 4, SiLU) over q, k and v,
    its state the last 3 inputs; then the gated delta rule, a prefill row through _torch_chunk_gated_delta_rule from
    its slot's state (once per sequence, as the adapter), a decode row inline; the gated norm per value head; the
    output projection (a TP all-reduce). Both states live in the sequence's mamba cache slot, never in the KV cache:
    every row continues from its slot (a prefix hit's tokens are not fed again). As the pinned adapter, a prefill
    from token 0 also continues from the slot, which is zeroed only when a new request takes it (a request
    preempted for recompute keeps its stale state; the flagship's prefix-state dispatch zeroes such a row)."""

    def __init__(self, text, kernel=4):
        super().__init__()
        from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

        size = _tp()[1]
        key_heads, value_heads = text.linear_num_key_heads, text.linear_num_value_heads
        self.dk, self.dv, self.ratio = text.linear_key_head_dim, text.linear_value_head_dim, value_heads // key_heads
        self.hk, self.hv, self.kernel = key_heads // size, value_heads // size, kernel
        parts = [key_heads * self.dk, key_heads * self.dk, value_heads * self.dv]
        self.conv_dim = sum(parts) // size
        self.in_proj_qkv = torch.nn.Linear(text.hidden_size, self.conv_dim, bias=False)
        _sharded(self.in_proj_qkv.weight, 0, parts)
        self.in_proj_z = ColumnParallelLinear(text.hidden_size, value_heads * self.dv, bias=False)
        self.in_proj_b = ColumnParallelLinear(text.hidden_size, value_heads, bias=False)
        self.in_proj_a = ColumnParallelLinear(text.hidden_size, value_heads, bias=False)
        self.conv1d_weight = _sharded(torch.nn.Parameter(torch.randn(self.conv_dim, 1, kernel) / kernel), 0, parts)
        self.A_log = _sharded(torch.nn.Parameter(torch.zeros(self.hv)), 0)
        self.dt_bias = _sharded(torch.nn.Parameter(torch.ones(self.hv)), 0)
        self.norm = Qwen3_5RMSNormGated(self.dv)
        self.out_proj = RowParallelLinear(value_heads * self.dv, text.hidden_size, bias=False)

    def state_shapes(self):
        """The mamba cache's per-slot conv and recurrent state shapes on this rank."""
        return (self.kernel - 1, self.conv_dim), (self.hv, self.dk, self.dv)

    def forward(self, hidden_states, attn_metadata, conv_state, temporal_state):
        tokens = hidden_states.shape[0]
        qkv = self.in_proj_qkv(hidden_states)
        z, _ = self.in_proj_z(hidden_states)
        z = z.view(tokens, self.hv, self.dv)
        b, _ = self.in_proj_b(hidden_states)
        a, _ = self.in_proj_a(hidden_states)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        beta = torch.sigmoid(b.float())
        weight = self.conv1d_weight[:, 0]
        core = []
        starts = [int(x) for x in attn_metadata.query_start_loc]
        for seq in range(len(starts) - 1):
            rows = slice(starts[seq], starts[seq + 1])
            window = torch.cat([conv_state[seq].to(qkv.dtype), qkv[rows]])
            conv_state[seq] = window[-(self.kernel - 1):]
            mixed = F.silu((window.unfold(0, self.kernel, 1) * weight).sum(-1))
            keys = self.hk * self.dk
            q, k = mixed[:, :keys].view(-1, self.hk, self.dk), mixed[:, keys:2 * keys].view(-1, self.hk, self.dk)
            v = mixed[:, 2 * keys:].reshape(-1, self.hv, self.dv)
            q, k = q.repeat_interleave(self.ratio, dim=1), k.repeat_interleave(self.ratio, dim=1)
            if seq < attn_metadata.num_prefills:
                out, state = _torch_chunk_gated_delta_rule(
                    q[None], k[None], v[None], g[rows][None], beta[rows][None],
                    initial_state=temporal_state[seq:seq + 1].clone(), output_final_state=True,
                    use_qk_l2norm_in_kernel=True)
                temporal_state[seq].copy_(state[0])
                core.append(out[0].float())
            else:  # decode, inline as the adapter's
                qd, kd = _l2norm(q[0].float()) * self.dk ** -0.5, _l2norm(k[0].float())
                state = temporal_state[seq]
                state.mul_(g[rows][0].exp()[:, None, None])
                u = beta[rows][0][:, None] * (v[0].float() - torch.einsum("hkv,hk->hv", state, kd))
                state.add_(kd[..., None] * u[:, None, :])
                core.append(torch.einsum("hkv,hk->hv", state, qd)[None])
        core = torch.cat(core).to(hidden_states.dtype)
        normed = self.norm(core.reshape(-1, self.dv), z.reshape(-1, self.dv)).reshape(tokens, -1)
        out, _ = self.out_proj(normed)
        return out


class Qwen3_5DecoderLayer(torch.nn.Module):
    """One layer as the adapter family writes it: input norm (fused with the residual after the first layer),
    full attention or GatedDeltaNet, post-attention norm, then the MoE block when the text config is the MoE one
    (the adapter picks it by text_config.model_type == 'qwen3_5_moe_text'); returns (hidden, residual)."""

    def __init__(self, text, layer_type, attn_idx, linear_idx, cache_config=None):
        super().__init__()
        self.layer_type = layer_type
        hidden = text.hidden_size
        self.input_layernorm, self.post_attention_layernorm = _Norm(hidden), _Norm(hidden)
        if layer_type == "full_attention":
            self.self_attn = Qwen3_5FullAttention(text, attn_idx, cache_config)
        else:
            self.linear_attn = GatedDeltaNet(text, getattr(text, "linear_conv_kernel_dim", 4))
            self.linear_idx = linear_idx
        moe = getattr(text, "model_type", "") == "qwen3_5_moe_text"
        self.mlp = None
        if moe:
            self.mlp = Qwen3_5MoeSparseBlock(text.num_experts, text.num_experts_per_tok, hidden,
                                             text.moe_intermediate_size, text.shared_expert_intermediate_size)

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


class Qwen3_5Model(torch.nn.Module):
    """The text model (the checkpoint's model.language_model.*): embedding, layers, final norm."""

    def __init__(self, text, cache_config=None):
        super().__init__()
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        self.embed_tokens = VocabParallelEmbedding(text.vocab_size, text.hidden_size)
        self.layers = torch.nn.ModuleList()
        attn_idx = linear_idx = 0
        for layer_type in text.layer_types:
            self.layers.append(Qwen3_5DecoderLayer(text, layer_type, attn_idx, linear_idx, cache_config))
            attn_idx += layer_type == "full_attention"
            linear_idx += layer_type != "full_attention"
        self.num_linear_layers = linear_idx
        self.norm = _Norm(text.hidden_size)


# ../shared/ADAPTER.md 4b: the 5a1c8c7 loader's renames and skips
_SKIPPED = ("model.visual", "mtp.", "model.mtp")
_RENAMES = (("model.language_model.", "model."), (".linear_attn.conv1d.weight", ".linear_attn.conv1d_weight"),
            (".mlp.shared_expert.down_proj.", ".mlp.shared_expert_down."))
_STACKED = ((".mlp.shared_expert.gate_proj.", ".mlp.shared_expert_gate_up.", 0),
            (".mlp.shared_expert.up_proj.", ".mlp.shared_expert_gate_up.", 1),
            (".mlp.gate_proj.", ".mlp.gate_up_proj.", 0), (".mlp.up_proj.", ".mlp.gate_up_proj.", 1))


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
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.sampler import Sampler
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        text = getattr(config, "text_config", config)
        self.block_size = cache_config.block_size if cache_config is not None else 16
        self.max_batch = scheduler_config.max_num_seqs if scheduler_config is not None else 8
        self.model = Qwen3_5Model(text, cache_config)
        self.lm_head = ParallelLMHead(text.vocab_size, text.hidden_size)
        self.logits_processor = LogitsProcessor(text.vocab_size)
        self.sampler = Sampler()
        self.mamba_cache = None
        self._gdn_prefix_cache = collections.OrderedDict()
        self._gdn_prefix_cache_max = 16
        self._block_size = self.block_size

    def forward(self, input_ids, positions, kv_caches, attn_metadata, intermediate_tensors=None, **kwargs):
        from vllm.model_executor.models.mamba_cache import MambaCacheManager

        if self.mamba_cache is None:
            linear = next(layer.linear_attn for layer in self.model.layers if layer.layer_type != "full_attention")
            self.mamba_cache = MambaCacheManager(torch.float32, self.model.num_linear_layers, self.max_batch,
                                                 *linear.state_shapes())
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
        h, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            h, residual = layer(positions, h, kv_caches, attn_metadata, residual, conv_states, temporal_states)
        hidden_states, _ = self.model.norm(h, residual)
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
        if sampling_metadata is None:  # the test harnesses' own loops, at TP 1: every row's logits
            return hidden_states @ self.lm_head.weight[:self.logits_processor.org_vocab_size].t()
        return self.logits_processor(self.lm_head, hidden_states, sampling_metadata)

    def sample(self, logits, sampling_metadata):
        return self.sampler(logits, sampling_metadata)

    def load_weights(self, weights):
        """The 5a1c8c7 loader's rules (../shared/ADAPTER.md 4b), a name that matches no parameter skipped silently
        as there."""
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        params = dict(self.named_parameters())
        for name, loaded in weights:
            if name.startswith(_SKIPPED) or "rotary_emb.inv_freq" in name:
                continue
            for old, new in _RENAMES:
                name = name.replace(old, new)
            if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
                fused = name.rsplit(".", 1)[0]
                for expert in range(loaded.shape[0]):
                    if name.endswith("gate_up_proj"):
                        gate, up = loaded[expert].chunk(2, dim=0)
                        self._expert(params, fused + ".w13_weight", gate, "w1", expert)
                        self._expert(params, fused + ".w13_weight", up, "w3", expert)
                    else:
                        self._expert(params, fused + ".w2_weight", loaded[expert], "w2", expert)
                continue
            if ".mlp.experts." in name and name.split(".mlp.experts.")[1].split(".")[0].isdigit():
                head, tail = name.split(".mlp.experts.")
                expert, proj = tail.split(".")[:2]
                target = head + (".mlp.experts.w2_weight" if proj == "down_proj" else ".mlp.experts.w13_weight")
                self._expert(params, target, loaded, {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj],
                             int(expert))
                continue
            for old, new, shard in _STACKED:
                if old in name:
                    name = name.replace(old, new)
                    if name in params:
                        params[name].weight_loader(params[name], loaded, shard)
                    break
            else:
                if name not in params:
                    continue
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, loaded)

    @staticmethod
    def _expert(params, name, loaded, shard, expert):
        if name in params:
            params[name].weight_loader(params[name], loaded, shard, expert)


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

TOOL_PARSER = r'''"""qwen3_coder tool parser (stand-in, written from the format the adapter's parser takes: <tool_call>
<function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>, values converted by the request's tool
schema; a whole call is streamed once its closing tag has arrived)."""
import json
import re

from vllm.entrypoints.openai.protocol import (DeltaFunctionCall, DeltaMessage, DeltaToolCall,
                                              ExtractedToolCallInformation, FunctionCall, ToolCall)
from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager

CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.S)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
START = "<tool_call>"


def _convert(value, schema):
    if (schema or {}).get("type") in ("integer", "number", "boolean", "object", "array"):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


@ToolParserManager.register_module("qwen3_coder")
class Qwen3CoderToolParser(ToolParser):
    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        for token in (START, "</tool_call>"):
            if token not in self.vocab:
                raise RuntimeError(f"qwen3_coder: {token} is not one token of the tokenizer")
        self.sent_content = 0

    def _calls(self, text, request):
        schemas = {t.function.name: (t.function.parameters or {}).get("properties", {})
                   for t in (request.tools or [])}
        calls = []
        for name, body in CALL.findall(text):
            name = name.strip()
            calls.append((name, {key.strip(): _convert(value, schemas.get(name, {}).get(key.strip()))
                                 for key, value in PARAMETER.findall(body)}))
        return calls

    def extract_tool_calls(self, model_output, request):
        calls = self._calls(model_output, request)
        if not calls:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        return ExtractedToolCallInformation(
            tools_called=True, content=model_output[:model_output.index(START)].strip() or None,
            tool_calls=[ToolCall(function=FunctionCall(name=n, arguments=json.dumps(a))) for n, a in calls])

    def extract_tool_calls_streaming(self, previous_text, current_text, delta_text, previous_token_ids,
                                     current_token_ids, delta_token_ids, request):
        start = current_text.find(START)
        visible = current_text if start < 0 else current_text[:start]
        # a partial "<tool_c" at the end may still become the tag: held back until it cannot
        held = 0 if start >= 0 else next((k for k in range(len(START) - 1, 0, -1) if visible.endswith(START[:k])), 0)
        content = visible[self.sent_content:len(visible) - held]
        self.sent_content += len(content)
        deltas = []
        for name, arguments in self._calls(current_text, request)[len(self.prev_tool_call_arr):]:
            self.current_tool_id += 1
            self.prev_tool_call_arr.append({"name": name, "arguments": arguments})
            self.streamed_args_for_tool.append(json.dumps(arguments))
            deltas.append(DeltaToolCall(index=self.current_tool_id, type="function", function=DeltaFunctionCall(
                name=name, arguments=json.dumps(arguments)).model_dump(exclude_none=True)))
        if not content and not deltas:
            return None
        return DeltaMessage(content=content or None, tool_calls=deltas)
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
    "qwen3_reasoning_parser.py": r'''from vllm.reasoning.abs_reasoning_parsers import (ReasoningParser,
                                                  ReasoningParserManager)


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    """Everything before </think> is reasoning (a generated <think> stripped); with thinking on, output cut off
    before </think> is all reasoning (stand-in, from ADAPTER.md section 5's description of the adapter's)."""

    start_token, end_token = "<think>", "</think>"

    def __init__(self, tokenizer, chat_template_kwargs=None, **kwargs):
        super().__init__(tokenizer, **kwargs)
        vocab = tokenizer.get_vocab()
        for token in (self.start_token, self.end_token):
            if token not in vocab:
                raise RuntimeError(f"qwen3 reasoning parser: {token} is not in the tokenizer's vocabulary")
        self.thinking = (chat_template_kwargs or {}).get("enable_thinking", True)
        self.sent, self.ended = 0, False

    def split(self, text):
        """(reasoning, content) of a whole output; content None while </think> has not come."""
        if not self.thinking:
            return None, text
        text = text[len(self.start_token):] if text.startswith(self.start_token) else text
        reasoning, end, content = text.partition(self.end_token)
        return (reasoning or None), (content if end else None)

    def split_streaming(self, previous_text, delta_text):
        """(reasoning delta, content delta) of one streamed delta, given the text before it."""
        if not self.thinking or self.ended:
            return None, delta_text
        reasoning, content = self.split(previous_text + delta_text)
        reasoning = reasoning or ""
        if content is None:
            # a partial "</thi" at the end may still become the end tag: held back until it cannot
            held = next((k for k in range(len(self.end_token) - 1, 0, -1)
                         if reasoning.endswith(self.end_token[:k])), 0)
            out = reasoning[self.sent:len(reasoning) - held]
        else:
            self.ended, out = True, reasoning[self.sent:]
        self.sent += len(out)
        return (out or None), content
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
                 layer_types=None, full_attention_interval=4, rope_theta=10000000.0, linear_num_key_heads=16,
                 linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, num_experts=256,
                 num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.linear_num_key_heads, self.linear_num_value_heads = linear_num_key_heads, linear_num_value_heads
        self.linear_key_head_dim, self.linear_value_head_dim = linear_key_head_dim, linear_value_head_dim
        self.num_experts, self.num_experts_per_tok = num_experts, num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
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
    "paged_attn.py": ("vllm/attention/ops/paged_attn.py",
                      "the V1/V2 choice moved into a function that forces V1; the image's decode call"),
    "mamba_cache.py": ("vllm/model_executor/models/mamba_cache.py", "a request's state slot zeroed when it takes it"),
    "sequence.py": ("vllm/sequence.py", "RequestMetrics.num_cached_tokens; no tokens for a chunk that adds none"),
    "scheduler.py": ("vllm/core/scheduler.py", "num_cached_tokens recorded as the block manager's whole hit"),
    "protocol.py": ("vllm/entrypoints/openai/protocol.py",
                    "PromptTokensDetails in UsageInfo, reasoning_content on messages; CRLF line endings"),
    "cli_args.py": ("vllm/entrypoints/openai/cli_args.py", "--reasoning-parser after --tool-parser-plugin"),
    "serving_chat.py": ("vllm/entrypoints/openai/serving_chat.py",
                        "the reasoning parser (streamed and not), cached tokens in the streamed usage"),
    "api_server.py": ("vllm/entrypoints/openai/api_server.py", "--reasoning-parser checked and passed on"),
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


# (anchor in the public file, what the stand-in adds after it, or "before" it), as the adapter's replacements do
EDITS: dict[str, list[tuple[str, ...]]] = {
    "mamba_cache.py": [("""            self.mamba_cache_indices_mapping[cur_rid] = {
                seq_id: destination_index
            }
""", """            for cache_t in self.mamba_cache:
                cache_t[:, destination_index].zero_()
""")],
    "sequence.py": [("""    model_execute_time: Optional[float] = None
""", """    num_cached_tokens: Optional[int] = None
"""), ("""        # Return new tokens
        if num_new_tokens == 1:
""", """        if num_new_tokens == 0:  # an intermediate chunk of a chunked prefill: `[-0:]` would be every token
            return []
""", "before")],
    "scheduler.py": [("""                common_computed_block_nums = (
                    self.block_manager.get_common_computed_block_ids(
                        seq_group.get_seqs(status=SequenceStatus.RUNNING)))
""", """                if seq_group.is_prefill() and seq_group.metrics.num_cached_tokens is None:
                    seq_group.metrics.num_cached_tokens = (
                        len(common_computed_block_nums) * self.block_manager.block_size)
""")],
    "protocol.py": [("""class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: List[ModelCard] = Field(default_factory=list)
""", """

class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0
"""), ("""    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: Optional[int] = 0
""", """    prompt_tokens_details: Optional[PromptTokensDetails] = None
"""), ("""class ChatMessage(OpenAIBaseModel):
    role: str
    content: Optional[str] = None
""", """    reasoning_content: Optional[str] = None
"""), ("""class DeltaMessage(OpenAIBaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
""", """    reasoning_content: Optional[str] = None
""")],
    "serving_chat.py": [("""from vllm.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
""", """from vllm.entrypoints.openai.protocol import PromptTokensDetails
from vllm.reasoning import ReasoningParserManager
"""), ("""                 tool_parser: Optional[str] = None""", """,
                 reasoning_parser: Optional[str] = None"""),
        ("""        self.tool_parser: Optional[Callable[[AnyTokenizer], ToolParser]] = None
""", """        self.reasoning_parser = (ReasoningParserManager.get_reasoning_parser(reasoning_parser)
                                 if reasoning_parser else None)
"""), ("""        num_prompt_tokens = 0
""", """        num_cached_tokens = 0
        reasoning_parsers = {}
        reasoning_previous = {}
"""), ("""                    num_prompt_tokens = len(res.prompt_token_ids)
""", """                    if res.metrics is not None and res.metrics.num_cached_tokens:
                        num_cached_tokens = res.metrics.num_cached_tokens
"""), ("""                    delta_text = output.text
""", """                    reasoning_delta = None
                    if self.reasoning_parser is not None:
                        if i not in reasoning_parsers:
                            reasoning_parsers[i] = self.reasoning_parser(
                                tokenizer, chat_template_kwargs=request.chat_template_kwargs)
                        previous = reasoning_previous.get(i, "")
                        reasoning_previous[i] = previous + delta_text
                        reasoning_delta, delta_text = reasoning_parsers[i].split_streaming(previous, delta_text)
                        delta_text = delta_text or ""
"""), ("""                    previous_num_tokens[i] += len(output.token_ids)
""", """                    if reasoning_delta:
                        if delta_message is None:
                            delta_message = DeltaMessage()
                        if not delta_message.content:
                            delta_message.content = None
                        delta_message.reasoning_content = reasoning_delta
"""), ("""                final_usage = UsageInfo(
                    prompt_tokens=num_prompt_tokens,
""", """                    prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens),
"""), ("""            auto_tools_called = False

""", """            reasoning = None
            if self.reasoning_parser is not None:
                reasoning, text = self.reasoning_parser(
                    tokenizer, chat_template_kwargs=request.chat_template_kwargs).split(output.text)
                output.text = text or ""
"""), ("""            choice_data = ChatCompletionResponseChoice(
                index=output.index,
                message=message,
""", """            message.reasoning_content = reasoning
""", "before")],
    "api_server.py": [("""        tool_parser=args.tool_call_parser""", """,
        reasoning_parser=getattr(args, "reasoning_parser", None)"""),
        ("""    valide_tool_parses = ToolParserManager.tool_parsers.keys()
""", """    from vllm.reasoning import ReasoningParserManager
    if getattr(args, "reasoning_parser", None) and \\
            args.reasoning_parser not in ReasoningParserManager.list_registered():
        raise KeyError(f"invalid reasoning parser: {args.reasoning_parser} "
                       f"(chose from {{ {','.join(ReasoningParserManager.list_registered())} }})")
""")],
}


def replacement(name: str, vendor_text: str) -> str:
    if name == "paged_attn.py":
        text, n = V1_CHOICE.subn("use_v1 = PagedAttention._should_use_paged_attention_v1(\n"
                                 "            max_seq_len, max_num_partitions, num_seqs, num_heads)", vendor_text)
        text = text.replace("    @staticmethod\n    def forward_decode(", V1_FUNCTION, 1)
        assert n == 1 and V1_FUNCTION in text, "the public paged_attn.py changed"
        # made from the image's file, as the adapter's is: its decode call passes ixformer's arguments only
        for edit in VENDOR_EDITS:
            if edit.file.endswith("/paged_attn.py") and "paged_attention_v1" in edit.pattern:
                text, n = re.subn(edit.pattern, edit.replacement, text)
                assert n == edit.matches, "the public paged_attn.py changed"
        return text
    if name in EDITS:
        text = vendor_text
        for anchor, addition, *where in EDITS[name]:
            assert text.count(anchor) == 1, f"the public {name} changed: {anchor!r}"
            text = text.replace(anchor, addition + anchor if where == ["before"] else anchor + addition)
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
