"""Test-side shims the runtime scripts share (run in the CPU runtime, never deployed): vLLM 0.6.3 code that
assumes a CUDA device, pointed at the CPU, and its distributed state for one process."""

import json
import os
import socket

import torch


class _CpuTorch:
    """`torch` as mamba_cache.py sees it: its `torch.empty` / `torch.zeros(..., device="cuda")` allocate on the
    CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, device=None, **kwargs):
        return torch.empty(*args, **kwargs)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, **kwargs)


class PoisonedTorch(_CpuTorch):
    """The same, with `torch.empty` handing out memory that held NaN (what an allocator may reuse)."""

    @staticmethod
    def empty(*args, device=None, **kwargs):
        return torch.empty(*args, **kwargs).fill_(float("nan"))


def on_cpu():
    from vllm.model_executor import sampling_metadata
    from vllm.model_executor.models import mamba_cache
    from vllm.worker import cache_engine, model_runner

    mamba_cache.torch = _CpuTorch()
    for module in (cache_engine, model_runner, sampling_metadata):  # a CPU torch pins no memory
        if hasattr(module, "is_pin_memory_available"):
            module.is_pin_memory_available = lambda: False


def distributed():
    """vLLM's parallel groups for one CPU process (gloo), which its parallel layers and the model runner need."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    initialize_model_parallel(1, 1)


# the linear-attention and MoE shapes of the harnesses' small hybrid configs: key and value
# head dims differ (a transposed state cannot pass), two value heads per key head, experts with top-2 routing
SMALL_HYBRID = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                "linear_value_head_dim": 12, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                "shared_expert_intermediate_size": 16,
                # the adapter reads its MRoPE split here since 2f7d5f5 (the published config's nesting): at head size
                # 64 a quarter rotated is 16 dims, 8 frequencies over time, height and width (tiny_model's rule)
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                    "mrope_section": [3, 3, 2], "mrope_interleaved": True}}


def vision_config(hidden_size):
    """The tiny vision tower the test gives (HARNESS_VISION_CONFIG, tiny_model's), projecting to `hidden_size`; a
    config without one builds the adapter's default tower, about 400M parameters to seed per model."""
    return dict(json.loads(os.environ["HARNESS_VISION_CONFIG"]), out_hidden_size=hidden_size)


def seeded(model, seed=0, std=0.15):
    """Seeded random values in every parameter of a model built without a checkpoint (vLLM's layers allocate
    theirs uninitialised)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=gen) * std)
    return model
