"""kernels: prebuilt device extension modules from a pinned source, installed into each vendor root.

A model adapter may ship compiled extension modules for the target's device architecture (the Qwen3.6 adapter's ten
CoreX modules at 2f7d5f5, imported as `from vllm import corex_<name>` and used only where the import worked and the
module's switch is on). As a plain deploy they would be opaque copies: nothing would check that the files are the
manifest's, that they were built for this image, or that the code path they switch on ever ran. This kind says, per
module, its import name, the switch and the call-site guard that decide whether the adapter uses it, and the
operation it takes over; every plan (the build, the image's apply, verify) checks the manifest against its pinned
digest, each artefact against the manifest, and each artefact's ELF header against the image's CPU. Nothing is
compiled anywhere: the image build needs no compiler, network or device.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from toolkit.errors import ToolkitError
from toolkit.fields import ENV_PATTERN, Identifier, Operation, Sha256, Strict
from toolkit.results import State
from toolkit.transforms.base import Context, Kind
from toolkit.transforms.deploy import OVERWRITE_HINT, Deploy, DeployKind
from toolkit.transforms.files import FilePlan, sha256

# ELF e_machine of each image CPU, by how a wheel platform tag (base_image.platform) ends
ELF_MACHINES = {"x86_64": 62, "aarch64": 183}
# the adapter's bi100_env.env_bool, exactly
SWITCH_VALUES = {**dict.fromkeys(("1", "true", "True", "yes", "YES", "on", "ON"), True),
                 **dict.fromkeys(("0", "false", "False", "no", "NO", "off", "OFF"), False)}
# `sha256sum` output: the digest, then two spaces (text mode) or a space and `*` (binary mode), then the name
MANIFEST_LINE = re.compile(r"([0-9a-fA-F]{64}) [ *](.+)")
PER_RANK = "/tp"  # a guard key ending in it compares the config value divided by the tensor-parallel size
# vLLM 0.6.3's --dtype spellings (config.py _STR_DTYPE_TO_TORCH_DTYPE); "auto" takes the checkpoint's
DTYPE_SPELLINGS = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32",
                   "float32": "float32"}


def served_dtype(arg: object, checkpoint_dtype: str) -> str:
    """The dtype vLLM 0.6.3 serves in for a --dtype value (None or auto: the checkpoint's, a float32 one as
    float16, as its _get_and_verify_dtype does)."""
    if isinstance(arg, str) and arg in DTYPE_SPELLINGS:
        return DTYPE_SPELLINGS[arg]
    return "float16" if checkpoint_dtype == "float32" else checkpoint_dtype


class KernelModule(Strict):
    name: Identifier = Field(description="The import name under dest's package (e.g. corex_gdn_causal_conv: "
                             "`from vllm import corex_gdn_causal_conv`); its artefact is the manifest's NAME.so")
    switch: str = Field(pattern=ENV_PATTERN, description="The env variable the adapter reads to use it")
    default: Literal["0", "1"] = Field(description="The switch's value when unset (the adapter's code default)")
    operation: Operation = Field(
        description="What it computes instead of the adapter's PyTorch path (e.g. moe.routed-experts.reduce); a "
        "variant that also switches on a native fast path's dispatch of that operation, or of the whole it is part "
        "of, is a lint error")
    guard: dict[str, int | str] = Field(
        default_factory=dict,
        description="The adapter's call-site guard, as the model shape it needs: `dtype` (the served dtype), "
        "`tokens` (a step's tokens: 1 for a one-token path), `context_over` (a sequence's context, in tokens), "
        "or a key of the model's (text) config, compared as is or, spelled KEY/tp, divided by the "
        "tensor-parallel size (e.g. linear_num_key_heads/tp: 4)")
    needs: dict[str, int | str] = Field(
        default_factory=dict,
        description="What the kernel itself refuses otherwise (its TORCH_CHECKs) where the call site does not guard "
        "it, in the guard's words: a switched-on module whose needs the served model does not meet raises on every "
        "call (a lint error)")

    def on(self, env: Mapping[str, str | None]) -> bool:
        """Whether the adapter uses it under this env (where it imports), read as the adapter's env_bool reads it:
        a value it does not know is refused here as it raises there."""
        value = env.get(self.switch)
        value = self.default if value is None else value
        if value not in SWITCH_VALUES:
            raise ToolkitError(f"{self.switch}={value!r}: the adapter's env_bool raises on it (the server stops)",
                               hint=f"one of {', '.join(SWITCH_VALUES)}")
        return SWITCH_VALUES[value]

    def unmet(self, config: dict[str, object], tp: int, dtype: str,
              which: Literal["guard", "needs"] = "guard") -> list[str]:
        """The conditions of the guard (or `needs`) that a model of this config, served at this TP and dtype, does
        not meet (`tokens` and `context_over` are properties of a step, not of the model: never unmet here)."""
        out = []
        for key, wanted in (self.guard if which == "guard" else self.needs).items():
            if key in STEP_KEYS:
                continue
            if key == "dtype":
                have: object = dtype
            else:
                value = config.get(key.removesuffix(PER_RANK))
                if value is None:
                    out.append(f"{key} {wanted} (the model's config has no {key.removesuffix(PER_RANK)})")
                    continue
                have = value
                if key.endswith(PER_RANK):
                    whole = int(value) if isinstance(value, int | float) and float(value).is_integer() else None
                    if whole is None or whole % tp:
                        out.append(f"{key} {wanted} (here {value} over TP {tp}, not a whole number per rank)")
                        continue
                    have = whole // tp
            if have != wanted:
                out.append(f"{key} {wanted} (here {have})")
        return out

    def step_conditions(self) -> list[str]:
        """The guard's conditions on a step, as words (a rehearsal can say which of its steps could reach it)."""
        return [STEP_KEYS[key].format(value) for key, value in self.guard.items() if key in STEP_KEYS]


STEP_KEYS = {"tokens": "a step of exactly {} token(s)", "context_over": "a context over {} tokens"}


class Kernels(Deploy):
    """Install a pinned set of prebuilt extension modules for one device architecture into every vendor root."""

    kind: Literal["kernels"]  # type: ignore[assignment]
    source: str = Field(description="The folder of artefacts for `architecture`, in a declared source: "
                        "@name/path (its files travel with the submission)")
    dest: str = Field(description="The package folder inside each vendor root the modules are imported from, "
                      "e.g. vllm")
    architecture: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="The device architecture the artefacts "
                              "were built for; applied only where hardware.device_arch is this")
    manifest: str = Field(default="SHA256SUMS", description="The sha256sum manifest beside the artefacts")
    manifest_sha256: Sha256 = Field(description="The manifest's own sha256: the pin every artefact digest "
                                    "hangs from")
    modules: list[KernelModule] = Field(min_length=1, description="Every module the manifest lists, exactly")

    @model_validator(mode="after")
    def _kernel_bundle(self) -> Kernels:
        if self.pinned is None:
            raise ValueError("kernels come from a declared source: write source as @name/path")
        if self.dest.startswith("/") or self.overwrite or self.replaces is not None:
            raise ValueError("kernels are installed inside the vendor roots (a relative dest), over no vendor file")
        names = [m.name for m in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"a module is declared twice: {sorted(n for n in names if names.count(n) > 1)}")
        return self

    def covers(self, rel: str) -> bool:
        """Only its artefacts (dest is the package folder they go into, which it does not own)."""
        return rel in {f"{self.dest.rstrip('/')}/{m.name}.so" for m in self.modules}

    @property
    def target_label(self) -> str:
        return f"{self.dest.rstrip('/')}/*.so ({len(self.modules)} prebuilt modules)"

    @property
    def package_name(self) -> str:
        return self.dest.strip("/").replace("/", ".")

    def import_names(self) -> list[str]:
        """The dotted names the tree imports (vllm.corex_gdn_causal_conv, ...)."""
        return [f"{self.package_name}.{m.name}" for m in self.modules]


def read_manifest(path: Path) -> dict[str, tuple[str, int]]:
    """A sha256sum manifest: artefact name -> (its digest, its line)."""
    out: dict[str, tuple[str, int]] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        found = MANIFEST_LINE.fullmatch(line)
        if found is None or "/" in found[2] or found[2] in out:
            raise ToolkitError(f"{path}:{number}: not a sha256sum line for one artefact: {line!r}",
                               hint="regenerate it with `sha256sum *.so > SHA256SUMS` beside the artefacts")
        out[found[2]] = (found[1].lower(), number)
    return out


def image_machine(platform: str | None) -> str:
    """The image's CPU, as its wheel platform tag ends (manylinux1_x86_64: x86_64)."""
    found = next((m for m in ELF_MACHINES if platform and platform.endswith(m)), None)
    if found is None:
        raise ToolkitError(f"base_image.platform {platform!r} names no CPU prebuilt kernels are checked for",
                           hint=f"a wheel platform tag ending in one of {', '.join(ELF_MACHINES)}")
    return found


def elf_problem(data: bytes, machine: str) -> str | None:
    """Why these bytes are not a 64-bit little-endian ELF for `machine`, or None."""
    if len(data) < 20 or data[:4] != b"\x7fELF":
        return "not an ELF file"
    if data[4:6] != b"\x02\x01":
        return "not a 64-bit little-endian ELF"
    found = struct.unpack_from("<H", data, 18)[0]
    if found != ELF_MACHINES[machine]:
        named = next((k for k, v in ELF_MACHINES.items() if v == found), f"machine {found}")
        return f"an ELF for {named}, not the image's {machine}"
    return None


class KernelsKind(DeployKind):
    def __init__(self, spec: Kernels, ctx: Context) -> None:
        super().__init__(spec, ctx)
        self.spec: Kernels = spec
        self.device_arch = ctx.device_arch
        manifest = self.source / spec.manifest
        where = f"transform {spec.id}"
        if not manifest.is_file():
            raise ToolkitError(f"{where}: no manifest {manifest}",
                               hint=f"the artefacts' folder holds a sha256sum manifest named {spec.manifest}")
        if (digest := sha256(manifest.read_bytes())) != spec.manifest_sha256:
            raise ToolkitError(
                f"{where}: {manifest} has sha256 {digest}, the recipe pins {spec.manifest_sha256}: the artefacts "
                "are not the ones the recipe was written for",
                hint="check the source's commit; if the new manifest is intended, set manifest_sha256 to it")
        listed = read_manifest(manifest)
        machine = image_machine(ctx.platform)
        wanted = {f"{m.name}.so" for m in spec.modules}
        if set(listed) != wanted:
            extra, missing = sorted(set(listed) - wanted), sorted(wanted - set(listed))
            raise ToolkitError(
                f"{where}: {manifest} lists {', '.join(extra) or 'nothing else'} beyond the declared modules and "
                f"lacks {', '.join(missing) or 'none of them'}",
                hint="declare exactly the manifest's modules under `modules:`")
        self.digests = {}
        for name, (expected, line) in sorted(listed.items()):
            path = self.source / name
            if not path.is_file():
                raise ToolkitError(f"{where}: {path} is missing ({manifest.name}:{line} lists it)")
            data = path.read_bytes()
            if (found := sha256(data)) != expected:
                raise ToolkitError(
                    f"{where}: {path} has sha256 {found}, not the manifest's {expected} ({manifest}:{line})",
                    hint="the artefact was changed after its manifest was written: take both from the pinned commit")
            if (problem := elf_problem(data, machine)) is not None:
                raise ToolkitError(f"{where}: {path} is {problem}",
                                   hint=f"use the artefacts built for the image ({machine}, {spec.architecture})")
            self.digests[name] = found
        # only the artefacts are installed: the manifest stays in the payload, where the image's apply reads it
        self.files = {name: self.source / name for name in sorted(listed)}

    def plan(self, base: Path, owned: dict[str, str], patched: frozenset[str] = frozenset()) -> FilePlan:
        if self.device_arch != self.spec.architecture:
            return FilePlan(State.GATED_OFF, f"built for {self.spec.architecture}; the target's device "
                            f"architecture is {self.device_arch or 'not declared (hardware.device_arch)'}")
        plan = super().plan(base, owned, patched)
        if plan.state is State.DRIFTED:  # never overwritten: a module there that this transform did not install
            return FilePlan(State.DRIFTED, plan.message.replace(OVERWRITE_HINT, "") + ": a prebuilt module this "
                            "transform did not install is there; if the image ships these kernels, drop the transform")
        digests = ", ".join(f"{name} {digest[:12]}" for name, digest in self.digests.items())
        return FilePlan(plan.state, f"{plan.message}; sha256 as {self.spec.manifest}: {digests}", plan.ops,
                        plan.owned)


KIND = Kind(Kernels, KernelsKind)
