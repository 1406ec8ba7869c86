"""The plain forward: a checkpoint's greedy answers computed outside vLLM, by code that shares nothing with the
served path (no vLLM, no adapter, no toolkit fast path), so an error they all make alike is still seen.

The composite hybrid architecture (Qwen3.5/3.6 MoE, `text_config` with `layer_types`) is written here from the
model's math, ../shared/DESIGN.md section 5, in float32, one function per part: zero-centred RMSNorm, gated full
attention with partial (neox) RoPE, GatedDeltaNet's causal conv and recurrence, the gated RMSNorm, the router, the
experts and the shared expert. It is the specification the served code is checked against: keep it plain. A single
config (Qwen2) is computed by transformers' own model class, the upstream implementation that fits that checkpoint
exactly. The host side (`reference_answers`) runs this file in the CPU runtime's Python, which has torch.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

COMPARED = "float32"
ROPE_THETA = 10_000_000  # the adapter's default where a config names none (qwen3_5.py, the attention's get_rope)
PREFIXES = ("model.language_model.", "model.")  # the composite checkpoint's text model, or a text-only one's


def reference_answers(python: Path, model: Path, prompts: list[Any], max_tokens: int, top: int) -> list[Any]:
    """Each prompt's greedy answer (`oracles.Answer`: ids, logprobs, the `top` alternatives) by the plain forward."""
    from toolkit.errors import ToolkitError
    from toolkit.pyenv import script
    from toolkit.rehearsal.oracles import Answer

    with tempfile.TemporaryDirectory(prefix="toolkit-plain-forward-") as tmp:
        request = Path(tmp) / "request.json"
        request.write_text(json.dumps({"model": str(model), "max_tokens": max_tokens, "top": top,
                                       "prompts": [list(p.ids) for p in prompts]}))
        out = Path(tmp) / "answers.json"
        proc = subprocess.run(script(python, Path(__file__), str(request), str(out)), capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}, nothing on stderr"])[-1]
            raise ToolkitError(f"the plain forward of {model} failed: {last}\n{proc.stderr[-3000:]}",
                               hint="toolkit/rehearsal/forward.py computes the reference answers; its error is above")
        found = json.loads(out.read_text())
    return [Answer(p, tuple(a["ids"]), tuple(a["logprobs"]), tuple({int(k): v for k, v in t.items()} for t in a["top"]))
            for p, a in zip(prompts, found, strict=True)]


# -- run in the CPU runtime (torch, safetensors) ----------------------------------------------------------------


def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    """Zero-centred RMSNorm: normalised, then multiplied by (1 + weight)."""
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * (1 + weight)


def gated_rms_norm(x: Any, z: Any, weight: Any, eps: float) -> Any:
    """GatedDeltaNet's output norm, per value head: normalised, times weight (not zero-centred), times silu(z)."""
    import torch.nn.functional as F

    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * weight * F.silu(z)


def l2_norm(x: Any, eps: float = 1e-6) -> Any:
    """Each head's vector over its own length, as upstream defines it: x * rsqrt(sum(x^2) + eps)."""
    return x * (x.pow(2).sum(-1, keepdim=True) + eps).rsqrt()


def rope(x: Any, positions: Any, rotary_dim: int, theta: float) -> Any:
    """Neox-style rotary embedding of the first `rotary_dim` dims of each head; x: [tokens, heads, head_dim]."""
    import torch

    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = positions.double()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().float()[:, None, :], angles.sin().float()[:, None, :]
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


class Model:
    """The composite hybrid text model, with a cache per layer so a prompt is computed once and each answer token
    after it is one step (the same code for both)."""

    def __init__(self, folder: Path) -> None:
        import torch
        from safetensors.torch import load_file

        config = json.loads((folder / "config.json").read_text())
        self.c = config["text_config"]
        self.w = {_unprefixed(k): v.to(torch.float32) for k, v in load_file(str(folder / "model.safetensors")).items()}
        if "lm_head.weight" not in self.w and self.c.get("tie_word_embeddings", config.get("tie_word_embeddings")):
            self.w["lm_head.weight"] = self.w["embed_tokens.weight"]
        self.eps = float(self.c["rms_norm_eps"])
        self.cache: list[dict[str, Any]] = []
        self.reset()

    def reset(self) -> None:
        """A new sequence: no layer has seen a token."""
        self.cache = [{} for _ in self.c["layer_types"]]

    def forward(self, ids: list[int], start: int) -> Any:
        """The logits of each of `ids` (at positions start, start + 1, ...), the layers' caches carried on."""
        import torch

        positions = torch.arange(start, start + len(ids))
        h = self.w["embed_tokens.weight"][torch.tensor(ids)]
        for i, kind in enumerate(self.c["layer_types"]):
            p = f"layers.{i}."
            x = rms_norm(h, self.w[p + "input_layernorm.weight"], self.eps)
            if kind == "full_attention":
                h = h + self.attention(p + "self_attn.", x, positions, self.cache[i])
            else:
                h = h + self.gated_delta_net(p + "linear_attn.", x, self.cache[i])
            h = h + self.mlp(p + "mlp.", rms_norm(h, self.w[p + "post_attention_layernorm.weight"], self.eps))
        return rms_norm(h, self.w["norm.weight"], self.eps) @ self.w["lm_head.weight"].T

    def attention(self, p: str, x: Any, positions: Any, cache: dict[str, Any]) -> Any:
        """Gated full attention: q and its per-head gate from q_proj, q and k normed per head, partial RoPE, causal
        softmax attention over the cached and new keys (query head h reads KV head h // (heads / kv_heads)), the
        output gated by sigmoid(gate)."""
        import torch

        c, w, tokens = self.c, self.w, x.shape[0]
        heads, kv_heads, dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        qg = (x @ w[p + "q_proj.weight"].T).view(tokens, heads, 2 * dim)
        q, gate = qg[..., :dim], qg[..., dim:]
        k = (x @ w[p + "k_proj.weight"].T).view(tokens, kv_heads, dim)
        v = (x @ w[p + "v_proj.weight"].T).view(tokens, kv_heads, dim)
        q, k = rms_norm(q, w[p + "q_norm.weight"], self.eps), rms_norm(k, w[p + "k_norm.weight"], self.eps)
        rope_of = {**c, **(c.get("rope_parameters") or {})}  # a newer config nests them there
        rotary = int(dim * rope_of.get("partial_rotary_factor", 0.25))
        theta = float(rope_of.get("rope_theta", ROPE_THETA))
        q, k = rope(q, positions, rotary, theta), rope(k, positions, rotary, theta)
        cache["k"] = k = torch.cat([cache["k"], k]) if "k" in cache else k
        cache["v"] = v = torch.cat([cache["v"], v]) if "v" in cache else v
        k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
        seen = k.shape[0] - tokens  # the new tokens are the last ones: each sees every earlier key and itself
        causal = torch.arange(k.shape[0])[None, :] <= (seen + torch.arange(tokens))[:, None]
        out = torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)
        out = out * torch.sigmoid(gate)
        return out.reshape(tokens, heads * dim) @ w[p + "o_proj.weight"].T

    def gated_delta_net(self, p: str, x: Any, cache: dict[str, Any]) -> Any:
        """GatedDeltaNet: q, k, v through a causal depthwise conv (the last kernel-1 inputs carried) and silu; q and
        k L2-normalised, q scaled by dk**-0.5, each value head reading key head h // (Hv / Hk); per token, the fp32
        state S [dk, dv] decays by exp(g), takes u = beta * (v - S^T k) as S += k u^T, and gives S^T q; the output
        gated-normed by z and projected."""
        import torch
        import torch.nn.functional as F

        c, w, tokens = self.c, self.w, x.shape[0]
        hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        dk, dv, kernel = c["linear_key_head_dim"], c["linear_value_head_dim"], c["linear_conv_kernel_dim"]
        mixed = x @ w[p + "in_proj_qkv.weight"].T  # [tokens, all q | all k | all v]
        before = cache.get("conv", torch.zeros(kernel - 1, mixed.shape[1]))
        padded = torch.cat([before, mixed])
        cache["conv"] = padded[-(kernel - 1):]
        taps = w[p + "conv1d.weight"][:, 0, :]  # [channels, kernel], the last tap on the newest input
        conv = F.silu((padded.unfold(0, kernel, 1) * taps).sum(-1))  # each token's window [channels, kernel]
        q, k, v = torch.split(conv, [hk * dk, hk * dk, hv * dv], dim=-1)
        q = l2_norm(q.view(tokens, hk, dk)).repeat_interleave(hv // hk, dim=1) * dk ** -0.5
        k = l2_norm(k.view(tokens, hk, dk)).repeat_interleave(hv // hk, dim=1)
        v = v.view(tokens, hv, dv)
        beta = torch.sigmoid(x @ w[p + "in_proj_b.weight"].T)
        g = -w[p + "A_log"].exp() * F.softplus(x @ w[p + "in_proj_a.weight"].T + w[p + "dt_bias"])
        state = cache.get("state", torch.zeros(hv, dk, dv))
        out = []
        for t in range(tokens):
            state = state * g[t].exp()[:, None, None]
            u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k[t]))
            state = state + k[t][:, :, None] * u[:, None, :]
            out.append(torch.einsum("hkv,hk->hv", state, q[t]))
        cache["state"] = state
        z = (x @ w[p + "in_proj_z.weight"].T).view(tokens, hv, dv)
        normed = gated_rms_norm(torch.stack(out), z, w[p + "norm.weight"], self.eps)
        return normed.reshape(tokens, hv * dv) @ w[p + "out_proj.weight"].T

    def mlp(self, p: str, x: Any) -> Any:
        """A layer's MLP: the mixture of experts where the layer has a router, else one dense SwiGLU."""
        w = self.w
        if p + "gate.weight" in w:
            return self.moe(p, x)
        return swiglu(x, w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"])

    def expert(self, p: str, e: int) -> tuple[Any, Any, Any]:
        """Expert e's gate, up and down weights: from the fused tensors (gate_up_proj: gate rows, then up rows) or
        from the expert's own."""
        w = self.w
        if p + "experts.gate_up_proj" in w:
            gate, up = w[p + "experts.gate_up_proj"][e].chunk(2, dim=0)
            return gate, up, w[p + "experts.down_proj"][e]
        one = f"{p}experts.{e}."
        return w[one + "gate_proj.weight"], w[one + "up_proj.weight"], w[one + "down_proj.weight"]

    def moe(self, p: str, x: Any) -> Any:
        """The router (softmax over experts, top-k, the k weights renormalised to sum 1), each chosen expert's
        SwiGLU, and the shared expert (where there is one) scaled by sigmoid(its gate)."""
        import torch

        w, top = self.w, self.c["num_experts_per_tok"]
        weights, chosen = (x @ w[p + "gate.weight"].T).softmax(-1).topk(top, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        routed = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            token, slot = (chosen == e).nonzero(as_tuple=True)
            routed.index_add_(0, token, weights[token, slot][:, None] * swiglu(x[token], *self.expert(p, e)))
        if p + "shared_expert.gate_proj.weight" not in w:
            return routed
        shared = swiglu(x, w[p + "shared_expert.gate_proj.weight"], w[p + "shared_expert.up_proj.weight"],
                        w[p + "shared_expert.down_proj.weight"])
        return routed + torch.sigmoid(x @ w[p + "shared_expert_gate.weight"].T) * shared


def swiglu(x: Any, gate: Any, up: Any, down: Any) -> Any:
    """silu(x gate^T) * (x up^T), projected by down: an expert, the shared expert, a dense MLP."""
    import torch.nn.functional as F

    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def _unprefixed(name: str) -> str:
    for prefix in PREFIXES:
        if name.startswith(prefix):
            return name.removeprefix(prefix)
    return name


def _upstream(folder: Path) -> Any:
    """A single config's checkpoint (Qwen2) through transformers' own model class, the same interface as Model."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()

    class Upstream:
        def __init__(self) -> None:
            self.past: Any = None

        def reset(self) -> None:
            self.past = None

        def forward(self, ids: list[int], start: int) -> Any:
            # transformers' own KV cache carries the sequence: recomputing it whole each token costs the prompt's
            # forward once per answer token (a minute of a second model's rehearsal)
            out = model(torch.tensor([ids]), past_key_values=self.past, use_cache=True)
            self.past = out.past_key_values
            return out.logits[0]

    return Upstream()


def greedy(model: Any, prompt: list[int], max_tokens: int, top: int) -> dict[str, Any]:
    """The greedy answer: each token the argmax of its logits, with its logprob and the top alternatives'."""
    import torch

    ids: list[int] = []
    logprobs: list[float] = []
    tops: list[dict[str, float]] = []
    model.reset()
    logits = model.forward(prompt, 0)[-1]
    for _ in range(max_tokens):
        lp = torch.log_softmax(logits.double(), -1)
        values, order = lp.topk(top)
        token = int(order[0])
        ids.append(token)
        logprobs.append(float(values[0]))
        tops.append({str(int(i)): float(v) for i, v in zip(order, values, strict=True)})
        logits = model.forward([token], len(prompt) + len(ids) - 1)[-1]
    return {"ids": ids, "logprobs": logprobs, "top": tops}


def main(request_path: Path, out_path: Path) -> None:
    import torch

    torch.set_grad_enabled(False)
    request = json.loads(request_path.read_text())
    folder = Path(request["model"])
    config = json.loads((folder / "config.json").read_text())
    hybrid = "layer_types" in config.get("text_config", {})
    model = Model(folder) if hybrid else _upstream(folder)  # read once; each prompt starts from reset caches
    answers = [greedy(model, prompt, request["max_tokens"], request["top"]) for prompt in request["prompts"]]
    out_path.write_text(json.dumps(answers))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
