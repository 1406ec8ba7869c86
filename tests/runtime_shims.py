"""Test-side shims the runtime scripts share (run in the CPU runtime, never deployed): vLLM 0.6.3 code that
assumes a CUDA device, pointed at the CPU."""

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
