"""A device model: what one operation of the served path costs on the recipe's accelerator, from its FLOPs and bytes
against the hardware's public figures (`hardware:` in the recipe) and the constants no specification gives, which a
calibration fits on what was measured on the target (`Calibration`).

An operation runs in a kernel launch plus the longer of its compute at the achieved fraction of the dtype's peak and
its memory traffic at the achieved fraction of the bandwidth (a roofline); a TP all-reduce costs a fixed latency
plus a ring's traffic over the cards' link, 2 (n - 1) / n of the buffer each way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from toolkit.errors import ToolkitError
from toolkit.recipe import Hardware

INTEGER_DTYPES = frozenset({"int64", "int32", "int16", "int8", "uint8", "bool", "none"})


@dataclass(frozen=True)
class Device:
    """The accelerator's public figures and how many of them one TP group spans."""

    bandwidth_gbs: float  # memory bandwidth, GB/s (10^9 bytes)
    peak_tflops: Mapping[str, float]  # dense peak per dtype name (bfloat16, float16, float32), 10^12 FLOP/s
    link_gbs: float  # between cards, each way, GB/s
    ranks: int

    def peak(self, dtype: str) -> float:
        try:
            return self.peak_tflops[dtype] * 1e12
        except KeyError:
            raise ToolkitError(f"no peak for {dtype} among the hardware's figures ({', '.join(self.peak_tflops)})",
                               hint="add it to hardware.peak_tflops in the recipe's image layer") from None


def device_of(hardware: Hardware, ranks: int) -> Device:
    """The recipe's accelerator as the model prices it, over `ranks` cards of one TP group."""
    missing = [name for name in ("bandwidth_gbs", "peak_tflops", "link_gbs") if getattr(hardware, name) is None]
    if missing:
        raise ToolkitError(f"the recipe's hardware ({hardware.accelerator}) gives no {', '.join(missing)}",
                           hint="add the accelerator's public figures under hardware: in its image layer")
    assert hardware.bandwidth_gbs and hardware.peak_tflops and hardware.link_gbs
    return Device(hardware.bandwidth_gbs, dict(hardware.peak_tflops), hardware.link_gbs, ranks)


@dataclass(frozen=True)
class Calibration:
    """The constants no specification gives, fitted on measurements of the target."""

    launch_us: float  # per kernel launch, host and device
    bandwidth_fraction: float  # of the peak bandwidth a kernel achieves
    compute_fraction: float  # of the dtype's peak a kernel achieves
    all_reduce_us: float  # fixed cost of one TP all-reduce (rendezvous, the host's wait)

    def __post_init__(self) -> None:
        if not (0 < self.bandwidth_fraction <= 1 and 0 < self.compute_fraction <= 1):
            raise ValueError(f"achieved fractions must lie in (0, 1]: {self}")
        if self.launch_us < 0 or self.all_reduce_us < 0:
            raise ValueError(f"costs cannot be negative: {self}")


@dataclass(frozen=True)
class Op:
    """One device operation of a step on one rank: its work, its traffic, where it runs."""

    name: str
    region: str
    flops: float
    bytes: float
    dtype: str
    collective: bool = False  # a TP all-reduce of `bytes`
    calls: float = 1  # launches of it (FLOPs and bytes are all of them together); scaled layers make it fractional
    shapes: str = ""  # its first tensor arguments' shapes, as the census saw them

    def __post_init__(self) -> None:
        if self.flops < 0 or self.bytes < 0 or self.calls <= 0:
            raise ValueError(f"an operation's FLOPs and bytes cannot be negative: {self}")


def seconds(op: Op, device: Device, calibration: Calibration) -> float:
    """The operation's time on one rank, all its calls (each an equal share of its FLOPs and bytes)."""
    if op.collective:
        if device.ranks == 1:
            return 0.0  # vLLM returns before reducing on one rank
        traffic = 2 * (device.ranks - 1) / device.ranks * op.bytes
        return op.calls * calibration.all_reduce_us * 1e-6 + traffic / (device.link_gbs * 1e9)
    # integer and boolean work (indices, masks) is priced at the fp32 peak; it is never the bound at these sizes
    dtype = op.dtype if op.dtype in device.peak_tflops or op.dtype not in INTEGER_DTYPES else "float32"
    compute = op.flops / (device.peak(dtype) * calibration.compute_fraction)
    memory = op.bytes / (device.bandwidth_gbs * 1e9 * calibration.bandwidth_fraction)
    return op.calls * calibration.launch_us * 1e-6 + max(compute, memory)
