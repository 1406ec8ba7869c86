"""A device model: what one operation of the served path costs on the recipe's accelerator, from its FLOPs and bytes
against the hardware's public figures (`hardware:` in the recipe) and the constants no specification gives, which a
calibration fits on what was measured on the target (`Calibration`).

An operation runs in a kernel launch plus the longer of its compute at the achieved fraction of the dtype's peak and
its memory traffic at the achieved fraction of the bandwidth (a roofline); a TP all-reduce costs its implementation's
latency plus a ring's traffic, 2 (n - 1) / n of the buffer each way, at its implementation's achieved rate. The
implementation is the variant's: ixformer's IPC all-reduce where its env sets ENABLE_CUSTOM_IPC=1 (`all_reduce_of`,
the one reader of that switch here), NCCL otherwise; vLLM's own custom all-reduce never runs on the target (CoreX
hard-codes it off, and vLLM 0.6.3 turns it off itself for more than two PCIe-only cards).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from toolkit.errors import ToolkitError
from toolkit.recipe import Hardware

INTEGER_DTYPES = frozenset({"int64", "int32", "int16", "int8", "uint8", "bool", "none"})
IPC_SWITCH = "ENABLE_CUSTOM_IPC"  # read by ixformer on the image (the image layer's gpu_libraries reads_env)
ALL_REDUCES = ("nccl", "ixformer-ipc")


def all_reduce_of(env: Mapping[str, str]) -> str:
    """The TP all-reduce a variant's env selects: ixformer's IPC one with ENABLE_CUSTOM_IPC=1, NCCL with it unset,
    empty or 0 (ixformer's own reading: it tests for "1"); any other value is refused, as a typo would silently
    price the wrong one."""
    value = env.get(IPC_SWITCH, "")
    if value == "1":
        return "ixformer-ipc"
    if value in ("", "0"):
        return "nccl"
    raise ToolkitError(f"{IPC_SWITCH}={value!r}: ixformer turns its IPC all-reduce on for 1 only",
                       hint=f"set {IPC_SWITCH} to 1 (IPC) or 0 (NCCL) in the recipe's env")


@dataclass(frozen=True)
class Device:
    """The accelerator's public figures and how many of them one TP group spans."""

    bandwidth_gbs: float  # memory bandwidth, GB/s (10^9 bytes)
    peak_tflops: Mapping[str, float]  # dense peak per dtype name (bfloat16, float16, float32), 10^12 FLOP/s
    link_gbs: float  # between cards, each way, GB/s
    ranks: int
    all_reduce: str = "nccl"  # the TP all-reduce's implementation (one of ALL_REDUCES): the variant's env decides

    def peak(self, dtype: str) -> float:
        try:
            return self.peak_tflops[dtype] * 1e12
        except KeyError:
            raise ToolkitError(f"no peak for {dtype} among the hardware's figures ({', '.join(self.peak_tflops)})",
                               hint="add it to hardware.peak_tflops in the recipe's image layer") from None


def device_of(hardware: Hardware, ranks: int, all_reduce: str = "nccl") -> Device:
    """The recipe's accelerator as the model prices it, over `ranks` cards of one TP group reducing with
    `all_reduce`."""
    missing = [name for name in ("bandwidth_gbs", "peak_tflops", "link_gbs") if getattr(hardware, name) is None]
    if missing:
        raise ToolkitError(f"the recipe's hardware ({hardware.accelerator}) gives no {', '.join(missing)}",
                           hint="add the accelerator's public figures under hardware: in its image layer")
    assert hardware.bandwidth_gbs and hardware.peak_tflops and hardware.link_gbs
    return Device(hardware.bandwidth_gbs, dict(hardware.peak_tflops), hardware.link_gbs, ranks, all_reduce)


@dataclass(frozen=True)
class AllReduce:
    """One all-reduce implementation as measured on the target: a call's fixed latency, and the rate its ring
    traffic (2 (n - 1) / n of the buffer) achieves."""

    latency_us: float
    gbs: float

    def __post_init__(self) -> None:
        if self.latency_us < 0 or self.gbs <= 0:
            raise ValueError(f"an all-reduce's latency cannot be negative nor its rate zero: {self}")


@dataclass(frozen=True)
class DecodeContext:
    """A decode's time against its context as the target measured it (one sequence): a line of seconds per token
    against context tokens on each side of `path_above` (where the served decode changes path), each through the
    figures that decided it. What it adds to a counted decode (`extra`) is its time at the decode's context less its
    time at the context the census decoded at."""

    path_above: int
    below: tuple[float, float]  # seconds a token at no context, seconds per context token: contexts under path_above
    above: tuple[float, float]  # the same from path_above on

    def seconds(self, context: float) -> float:
        start, slope = self.above if context >= self.path_above else self.below
        return start + slope * context

    def extra(self, context: float, counted_at: float) -> float:
        return max(self.seconds(context) - self.seconds(counted_at), 0.0)


@dataclass(frozen=True)
class Calibration:
    """The constants no specification gives, fitted on measurements of the target."""

    launch_us: float  # per kernel launch, host and device
    bandwidth_fraction: float  # of the peak bandwidth a kernel achieves
    compute_fraction: float  # of the dtype's peak a kernel achieves
    all_reduce: Mapping[str, AllReduce] = field(default_factory=dict)  # per implementation (ALL_REDUCES)
    decode_context: DecodeContext | None = None  # None: a decode costs what the census counted, at any context

    def __post_init__(self) -> None:
        if not (0 < self.bandwidth_fraction <= 1 and 0 < self.compute_fraction <= 1):
            raise ValueError(f"achieved fractions must lie in (0, 1]: {self}")
        if self.launch_us < 0:
            raise ValueError(f"costs cannot be negative: {self}")
        unknown = sorted(set(self.all_reduce) - set(ALL_REDUCES))
        if unknown:
            raise ValueError(f"all-reduce implementation(s) {', '.join(unknown)}: not one of {', '.join(ALL_REDUCES)}")

    def reduce(self, implementation: str) -> AllReduce:
        try:
            return self.all_reduce[implementation]
        except KeyError:
            have = ", ".join(self.all_reduce) or "none"
            raise ToolkitError(f"the calibration prices no {implementation} all-reduce (it has: {have})",
                               hint="refit it with that implementation's measured times: `toolkit estimate RECIPE "
                               "--calibrate DIR --timings FILE --write NEW`") from None


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
        measured = calibration.reduce(device.all_reduce)
        return op.calls * measured.latency_us * 1e-6 + traffic / (measured.gbs * 1e9)
    # integer and boolean work (indices, masks) is priced at the fp32 peak; it is never the bound at these sizes
    dtype = op.dtype if op.dtype in device.peak_tflops or op.dtype not in INTEGER_DTYPES else "float32"
    compute = op.flops / (device.peak(dtype) * calibration.compute_fraction)
    memory = op.bytes / (device.bandwidth_gbs * 1e9 * calibration.bandwidth_fraction)
    return op.calls * calibration.launch_us * 1e-6 + max(compute, memory)
