"""A per-card memory estimate for serving: weights, KV cache, linear-attention state, activations.

Only full-attention layers carry a KV cache that grows with context; linear-attention (GatedDeltaNet)
layers keep a fixed state per sequence. vLLM gives the KV cache whatever is left of
gpu_memory_utilization x card memory after weights and the profiling peak, and refuses to start
when one max_model_len sequence does not fit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from toolkit.recipe import ModelShape, VisionTower

GIB = 1024**3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 0, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
# live hidden-sized buffers at the profiling peak (residual, norm outputs, attention and MoE intermediates):
# a rule of thumb, not a measurement; the margin warning absorbs its error
ACTIVATION_BUFFERS = 20
BLOCK_SIZE = 16


@dataclass(frozen=True)
class KvEstimate:
    card_gib: float
    budget_gib: float  # gpu_memory_utilization x card
    weights_gib: float
    activations_gib: float
    vision_gib: float  # the start's profile of its max-size images through the vision tower
    overhead_gib: float
    linear_state_gib: float  # all sequences
    kv_per_token_bytes: int
    kv_needed_gib: float  # one max_model_len sequence
    kv_available_gib: float
    max_model_len: int
    max_num_seqs: int
    attention_layers: int  # what vLLM 0.6.3 allocates KV for
    accounting: str  # which rule decided attention_layers, said in every finding

    @property
    def fits(self) -> bool:
        return self.kv_available_gib >= self.kv_needed_gib

    @property
    def margin(self) -> float:
        """Spare memory after one full-length sequence, as a fraction of the budget."""
        return (self.kv_available_gib - self.kv_needed_gib) / self.budget_gib

    @property
    def full_length_sequences(self) -> float:
        return self.kv_available_gib / self.kv_needed_gib if self.kv_needed_gib else float("inf")

    def summary(self) -> str:
        return (
            f"per card: budget {self.budget_gib:.2f} GiB (of {self.card_gib:g}) = weights {self.weights_gib:.2f} "
            f"+ activations {self.activations_gib:.2f}"
            + (f" + vision profile {self.vision_gib:.2f}" if self.vision_gib else "")
            + f" + overhead {self.overhead_gib:.2f} + linear-attention state "
            f"{self.linear_state_gib:.3f} ({self.max_num_seqs} seqs) + KV available {self.kv_available_gib:.2f}; "
            f"one {self.max_model_len}-token sequence needs {self.kv_needed_gib:.2f} GiB of KV "
            f"({self.kv_per_token_bytes} B/token/card, {self.accounting}), room for {self.full_length_sequences:.1f}"
        )

    def as_json(self) -> dict[str, float | int | bool]:
        data: dict[str, float | int | bool] = dict(asdict(self))
        data.update(fits=self.fits, margin=round(self.margin, 4))
        return data


def linear_state_bytes(model: ModelShape, tp: int) -> int:
    """One sequence's linear-attention state per card, every linear layer's conv and recurrent state: what the
    mamba cache holds per sequence, and what one prefix-state checkpoint copies to host memory."""
    la = model.linear_attention
    linear_layers = sum(1 for i in range(model.num_layers) if (i + 1) % model.full_attention_interval != 0)
    if la is None or not linear_layers:
        return 0
    state = (la.num_value_heads // tp) * la.key_head_dim * la.value_head_dim * 4  # fp32 recurrent state
    channels = 2 * la.num_key_heads * la.key_head_dim + la.num_value_heads * la.value_head_dim
    conv = channels // tp * (la.conv_kernel - 1) * DTYPE_BYTES[model.dtype]
    return linear_layers * (state + conv)


def vision_profile(vision: VisionTower, images: int, dtype_bytes: int) -> tuple[float, float]:
    """What vLLM's start profile of `images` max-size images costs in the vision tower: its peak bytes (one block's
    live buffers over every image's patches: the input, the norm, q/k/v, the attention output, the MLP's
    intermediate and its activation; the blocks run one after another and the attention is xformers' memory-efficient
    one, so nothing grows with the patches squared in memory) and its FLOPs (the blocks' matmuls and attention, each
    image attending within itself). Replicated on every card: the tower is not sharded by TP here."""
    patches = vision.max_image_tokens * vision.spatial_merge_size ** 2  # per image
    h, i = vision.hidden_size, vision.intermediate_size
    peak = images * patches * (6 * h + 2 * i) * dtype_bytes
    per_block = 2 * patches * (4 * h * h + 2 * h * i) + 4 * patches * patches * h
    return float(peak), float(images * vision.depth * per_block)


def estimate(model: ModelShape, *, card_gib: float, overhead_gib: float, tp: int, max_model_len: int,
             max_num_seqs: int, max_num_batched_tokens: int, gpu_memory_utilization: float,
             kv_cache_dtype: str = "auto", env: dict[str, str] | None = None, images: int = 1) -> KvEstimate:
    """env: the server's environment (a variant's), which decides the accounting when the config classes compute
    layers_block_type from a switch; images: the max-size images the start profiles (--limit-mm-per-prompt)."""
    dtype = DTYPE_BYTES[model.dtype]
    kv_dtype = DTYPE_BYTES.get(kv_cache_dtype, 0) or dtype
    full_layers = sum(1 for i in range(model.num_layers) if (i + 1) % model.full_attention_interval == 0)
    kv_heads = max(1, model.num_kv_heads // tp)  # vLLM replicates KV heads when TP exceeds them
    # vLLM 0.6.3's ModelConfig.get_num_attention_layers: every layer, unless the config's layers_block_type says
    env = env or {}
    if model.counts_full_attention_only(env):
        attention_layers = full_layers
        accounting = f"{full_layers} full-attention layers ({model.accounting_source(env)})"
    else:
        attention_layers = model.num_layers
        why = ("the served config declares no layers_block_type" if isinstance(model.layers_block_type, bool)
               else f"its config classes count every layer with {model.accounting_source(env).split(', ')[1]}")
        accounting = (f"all {model.num_layers} layers: {why}, so vLLM 0.6.3 counts every layer as attention"
                      if full_layers != model.num_layers else f"{model.num_layers} attention layers")
    per_token = attention_layers * 2 * kv_heads * model.head_dim * kv_dtype
    tokens = -(-max_model_len // BLOCK_SIZE) * BLOCK_SIZE
    linear = linear_state_bytes(model, tp) * max_num_seqs
    weights = model.params_b * 1e9 * dtype / tp
    activations = max_num_batched_tokens * model.hidden_size * dtype * ACTIVATION_BUFFERS
    # the profile's peak: the tower runs before the language model, whose activations are counted above; both
    # counted, as its image embeddings stay alive into the language model's pass
    vision = vision_profile(model.vision, images, dtype)[0] if model.vision is not None else 0.0
    budget = card_gib * GIB * gpu_memory_utilization
    available = budget - weights - activations - vision - overhead_gib * GIB - linear
    return KvEstimate(
        card_gib=card_gib, budget_gib=budget / GIB, weights_gib=weights / GIB, activations_gib=activations / GIB,
        vision_gib=vision / GIB, overhead_gib=overhead_gib, linear_state_gib=linear / GIB, kv_per_token_bytes=per_token,
        kv_needed_gib=tokens * per_token / GIB, kv_available_gib=available / GIB,
        max_model_len=max_model_len, max_num_seqs=max_num_seqs, attention_layers=attention_layers,
        accounting=accounting,
    )
