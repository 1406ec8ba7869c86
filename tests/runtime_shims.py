"""Test-side shims the runtime scripts share (run in the CPU runtime, never deployed): vLLM 0.6.3 code that
assumes a CUDA device, pointed at the CPU, and its distributed state for one process."""

import socket

import torch


class _CpuTorch:
    """`torch` as mamba_cache.py sees it: its `torch.empty(..., device="cuda")` allocates on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, device=None, **kwargs):
        return torch.empty(*args, **kwargs)


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
