"""The recipe: pydantic models, loaded from YAML with file:line errors."""

from __future__ import annotations

import functools
import operator
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from toolkit.errors import RecipeError
from toolkit.fields import ENV_PATTERN, ID_PATTERN, DottedName, Identifier, Strict, relative_path
from toolkit.layers import GROUP_DEFAULTS, INCLUDE, INSTEAD_OF, TOOLKIT_LAYER, compose, error_at, where
from toolkit.resources import TOOLKIT_PATCHES, resource
from toolkit.results import Origin
from toolkit.transforms import KINDS
from toolkit.transforms.base import TransformBase
from toolkit.transforms.deploy import Deploy
from toolkit.transforms.kernels import Kernels
from toolkit.yamlpos import Located, YamlLoadError, load


class Hardware(Strict):
    vendor: str = Field(description="GPU vendor, e.g. iluvatar")
    accelerator: str = Field(description="Accelerator model, e.g. BI-V100")
    count: int = Field(ge=1, description="Accelerators per server")
    memory_gb: float = Field(gt=0, description="Memory per accelerator in GiB")
    known_issues: list[Literal["cuda-graph-capture-hang"]] = Field(
        default_factory=list, description="Failure modes known on this hardware (drive lint rules)")
    runtime_overhead_gb: float = Field(
        default=1.0, ge=0, description="Per-card memory outside vLLM's accounting (runtime, NCCL buffers), GiB")
    # the public figures a device model prices operations against (toolkit.estimate.device)
    bandwidth_gbs: float | None = Field(default=None, gt=0, description="Memory bandwidth per card, GB/s")
    peak_tflops: dict[str, float] | None = Field(
        default=None, description="Dense peak per dtype (bfloat16, float16, float32), TFLOP/s per card")
    link_gbs: float | None = Field(default=None, gt=0, description="Bandwidth between cards, each way, GB/s "
                                   "(PCIe 4.0 x16: 32)")
    device_arch: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9_.-]+$",
        description="The device architecture prebuilt kernels must be built for (the BI-V100's ivcore10): a "
        "kernels transform for another one is GATED_OFF")


class GpuLibrary(Strict):
    """A GPU library of the image, with what of it the image does not have."""

    name: DottedName = Field(description="The top-level module (or a compiled extension), e.g. ixformer")
    absent: list[DottedName] = Field(
        default_factory=list,
        description="Submodules the image does not provide: importing one raises ImportError off the image too, so "
        "the vendor's own fallback runs (e.g. ixformer.contrib.vllm_flash_attn: the selector then takes XFORMERS)")
    reads_env: list[Annotated[str, Field(pattern=ENV_PATTERN)]] = Field(
        default_factory=list,
        description="Env variables the library itself reads on the image (e.g. ixformer's ENABLE_CUSTOM_IPC, its IPC "
        "all-reduce): a recipe may set them though no file of the patched tree reads them (lint and preflight "
        "say where they are read, not that they are unread); its stand-in on a CPU does not read them")
    why: str | None = Field(default=None, description="Why the image has it (or lacks those), for the reports")

    @model_validator(mode="after")
    def _inside(self) -> GpuLibrary:
        outside = [a for a in self.absent if not a.startswith(self.name + ".")]
        if outside:
            raise ValueError(f"absent module(s) {', '.join(outside)} are not under {self.name}")
        return self


class BaseImage(Strict):
    reference: str = Field(min_length=1, description="The vendor image the submission builds FROM")
    python: str = Field(pattern=r"^3\.\d+$", description="Python version inside the image, e.g. 3.10")
    platform: str = Field(default="manylinux1_x86_64", description="Wheel platform tag of the image")
    attention_backends: list[str] = Field(
        default_factory=lambda: ["XFORMERS"],
        description="Attention backends the image can load; the first is the one vLLM picks by default")
    gpu_libraries: list[GpuLibrary] = Field(
        default_factory=list,
        description="Modules only the image has that the vendor tree imports at module level: its GPU libraries "
        "(e.g. ixformer, xformers, triton), or a compiled extension a copy of the tree lacks (e.g. vllm._C); a "
        "name, or {name, absent, why}. Preflight and the CPU runtime stand them in (importable; a call from a "
        "function raises, naming it and the caller), except the `absent` submodules, which fail to import as on "
        "the image")

    @field_validator("gpu_libraries", mode="before")
    @classmethod
    def _named(cls, value: Any) -> Any:
        return [{"name": item} if isinstance(item, str) else item for item in value] if isinstance(value, list) \
            else value

    @property
    def gpu_library_names(self) -> list[str]:
        return [library.name for library in self.gpu_libraries]

    @property
    def absent_modules(self) -> list[str]:
        return [name for library in self.gpu_libraries for name in library.absent]

    def env_reader(self, name: str) -> str | None:
        """The GPU library that reads an env variable itself on the image, if one does."""
        return next((library.name for library in self.gpu_libraries if name in library.reads_env), None)


class Vendor(Strict):
    package: str = Field(default="vllm", description="The vendor-patched package")
    version: str = Field(description="Version specifier the vendor roots must satisfy, e.g. ==0.6.3+corex.3.2.3")
    roots: list[str] = Field(min_length=1, description="Absolute site-packages folders inside the image")
    reference: str = Field(
        description="The public release (name==version) used to check transforms off-image: the vendor's true "
        "base, e.g. vllm==0.6.3 (`toolkit vendor compare` finds it)"
    )
    hardcoded: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Keyword arguments the vendor hard-codes -> the serving flags that do nothing until a "
        "set-kwarg transform un-hardcodes them",
    )

    @field_validator("version")
    @classmethod
    def _spec(cls, value: str) -> str:
        try:
            SpecifierSet(value)
        except InvalidSpecifier:
            raise ValueError(f"not a version specifier: {value!r} (example: ==0.6.3+corex.3.2.3)") from None
        return value

    @field_validator("roots")
    @classmethod
    def _absolute(cls, roots: list[str]) -> list[str]:
        for root in roots:
            if not root.startswith("/"):
                raise ValueError(f"vendor roots are absolute paths inside the image, got {root!r}")
        if len(set(roots)) != len(roots):
            raise ValueError("vendor roots are listed twice")
        return roots

    @field_validator("reference")
    @classmethod
    def _pinned(cls, value: str) -> str:
        name, sep, version = value.partition("==")
        if not sep or not name or not version:
            raise ValueError(f"reference must be pinned as name==version, got {value!r}")
        try:
            Version(version)
        except InvalidVersion:
            raise ValueError(f"not a version: {version!r}") from None
        return value

    @property
    def reference_name(self) -> str:
        return self.reference.partition("==")[0]

    @property
    def reference_version(self) -> str:
        return self.reference.partition("==")[2]


if typing.TYPE_CHECKING:
    Transform = TransformBase
else:  # the discriminated union of every registered kind's model
    Transform = Annotated[functools.reduce(operator.or_, (k.model for k in KINDS.values())),
                          Field(discriminator="kind")]
TRANSFORM_MODELS: dict[str, type[TransformBase]] = {name: k.model for name, k in KINDS.items()}

ArgValue = str | int | float | bool | list[str] | None


class Workload(Strict):
    """What the evaluation sends that the serving arguments must hold (lint's context-length rule reads it)."""

    min_context_tokens: int | None = Field(
        default=None, ge=1, description="A context the workload needs more than (max-model-len must exceed it)")
    largest_prompt_tokens: int | None = Field(
        default=None, ge=1, description="The workload's largest prompt, in the model's tokens (the platform's "
        "replay: 254336, its request 113)")
    largest_prompt_completion_limit: int | None = Field(
        default=None, ge=1, description="The completion limit (max_completion_tokens) that largest prompt asks: "
        "vLLM refuses it unless prompt plus limit fit max-model-len (the platform's replay: 4096)")

    @model_validator(mode="after")
    def _largest_whole(self) -> Workload:
        if (self.largest_prompt_tokens is None) != (self.largest_prompt_completion_limit is None):
            raise ValueError("largest_prompt_tokens and largest_prompt_completion_limit describe one request: give "
                             "both or neither")
        return self

    @property
    def largest_request(self) -> int | None:
        """The context the largest prompt needs with its completion limit, or None when not declared."""
        if self.largest_prompt_tokens is None or self.largest_prompt_completion_limit is None:
            return None
        return self.largest_prompt_tokens + self.largest_prompt_completion_limit


class Serve(Strict):
    module: DottedName = Field(default="vllm.entrypoints.openai.api_server", description="python3 -m MODULE")
    workdir: str = Field(default="/workspace", description="Neutral working directory (no vllm/ folder in it)")
    concurrency: int = Field(default=1, ge=1, description="The platform's concurrency setting")
    args: dict[str, ArgValue] = Field(
        default_factory=dict,
        description="Server flags without leading dashes; true = bare flag, false/null = omitted",
    )
    workload: Workload = Field(default_factory=Workload, description="What the evaluation sends that the serving "
                               "arguments must hold")


class LinearAttention(Strict):
    num_key_heads: int = Field(ge=1)
    num_value_heads: int = Field(ge=1)
    key_head_dim: int = Field(ge=1)
    value_head_dim: int = Field(ge=1)
    conv_kernel: int = Field(default=4, ge=1)


class MixtureOfExperts(Strict):
    """The routed experts of each layer's MLP (the estimate builds its layers at these widths)."""

    num_experts: int = Field(ge=1)
    experts_per_token: int = Field(ge=1, description="top-k")
    intermediate_size: int = Field(ge=1, description="each routed expert's intermediate width")
    shared_intermediate_size: int = Field(default=0, ge=0, description="the shared expert's (0: none)")


class ConfigFallback(Strict):
    """A model the reference tree and the stock transformers know, with the same attention shape."""

    model_type: str = Field(description="e.g. qwen2_moe")
    architecture: Identifier = Field(description="e.g. Qwen2MoeForCausalLM")


class KvAccountingSwitch(Strict):
    """The served config's classes compute layers_block_type themselves, as an env switch decides (the flagship's
    hybrid-kv-accounting transforms): lint and preflight count what vLLM will count for each variant's env."""

    switch: str = Field(pattern=ENV_PATTERN, description="The env var, e.g. HYBRID_KV_ACCOUNTING")
    when: str = Field(description="The value under which only the full-attention layers count, e.g. full_attention")
    otherwise: str = Field(description="The value under which every layer counts (vLLM's own count), e.g. legacy40")
    default: str = Field(description="What the config classes use when the env does not set the switch")

    @model_validator(mode="after")
    def _default_is_a_value(self) -> KvAccountingSwitch:
        if self.default not in (self.when, self.otherwise):
            raise ValueError(f"default {self.default!r} is neither `when` ({self.when!r}) nor `otherwise` "
                             f"({self.otherwise!r})")
        return self


class VisionTower(Strict):
    """The vision tower of a multimodal model, as the start's profile runs it (lint: mm-profile and the KV budget)."""

    max_image_tokens: int = Field(ge=1, description="The language-model tokens one max-size image becomes (the "
                                  "adapter's _MAX_IMAGE_TOKENS: 1280); the start profiles each allowed image at this")
    hidden_size: int = Field(ge=1, description="The tower's width (vision_config.hidden_size)")
    intermediate_size: int = Field(ge=1, description="Its MLP's width (vision_config.intermediate_size)")
    depth: int = Field(ge=1, description="Its blocks (vision_config.depth)")
    spatial_merge_size: int = Field(default=2, ge=1, description="Patches merged per side into one token")


class ModelShape(Strict):
    """What the KV-cache estimate needs to know about the served model."""

    params_b: float = Field(gt=0, description="Total parameters, billions (all experts)")
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    hidden_size: int = Field(ge=1)
    num_layers: int = Field(ge=1)
    full_attention_interval: int = Field(
        default=1, ge=1, description="Layer i is full attention when (i + 1) % interval == 0; others are linear")
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    linear_attention: LinearAttention | None = None
    moe: MixtureOfExperts | None = Field(default=None, description="The MLP's routed experts (toolkit estimate "
                                         "counts the served path at these widths)")
    vocab_size: int | None = Field(default=None, ge=1, description="The LM head's rows (toolkit estimate)")
    vision: VisionTower | None = Field(default=None, description="The vision tower, where the served model takes "
                                       "images (vLLM profiles --limit-mm-per-prompt max-size images at start)")
    architecture: Identifier | None = Field(
        default=None, description="The architecture the served config.json declares, e.g. Qwen3_5MoeForCausalLM "
        "(preflight resolves it through the patched registry)")
    model_type: str | None = Field(default=None, description="The served config's model_type, e.g. qwen3_5_moe")
    num_attention_heads: int | None = Field(
        default=None, ge=1, description="Query heads of a full-attention layer (default hidden/head_dim)")
    layers_block_type: bool | KvAccountingSwitch = Field(
        default=False, description="Whether the served config declares layers_block_type (true: serialized in its "
        "config.json), or the env switch under which its config classes compute it; without it vLLM 0.6.3 counts "
        "every layer as attention when it sizes the KV cache")
    text_config: bool = Field(
        default=False, description="The served config.json keeps the text model's shape under text_config (a "
        "composite config such as Qwen3.5/3.6's); preflight writes it so")
    prefix_state: Literal["exact-checkpoints", "none"] | None = Field(
        default=None, description="How the linear-attention layers' state survives a prefix-cache hit (their state "
        "is not in the KV cache, and vLLM 0.6.3 feeds a hit's uncached tokens only): `exact-checkpoints`, the "
        "prefix-state transforms restore a state captured at exactly the hit's block boundary (lint checks the "
        "recipe has them, preflight the patched files); `none`, nothing carries it, so --enable-prefix-caching is "
        "refused. Required when a model with linear_attention serves with prefix caching")
    def hybrid_config(self) -> dict[str, Any] | None:
        """The served (text) config's widths as the recipe gives them, for the composite hybrid config (Qwen3.5/3.6:
        text_config, linear attention, experts, vocabulary); None where the recipe does not give them all."""
        linear, moe = self.linear_attention, self.moe
        if not self.text_config or linear is None or moe is None or self.vocab_size is None:
            return None
        return {"hidden_size": self.hidden_size, "num_hidden_layers": self.full_attention_interval,
                "num_attention_heads": self.num_attention_heads or self.hidden_size // self.head_dim,
                "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "vocab_size": self.vocab_size,
                "full_attention_interval": self.full_attention_interval,
                "linear_num_key_heads": linear.num_key_heads, "linear_num_value_heads": linear.num_value_heads,
                "linear_key_head_dim": linear.key_head_dim, "linear_value_head_dim": linear.value_head_dim,
                "linear_conv_kernel_dim": linear.conv_kernel, "num_experts": moe.num_experts,
                "num_experts_per_tok": moe.experts_per_token, "moe_intermediate_size": moe.intermediate_size,
                "shared_expert_intermediate_size": moe.shared_intermediate_size}

    def counts_full_attention_only(self, env: dict[str, str]) -> bool:
        """Whether vLLM 0.6.3 counts only the full-attention layers, with this env."""
        rule = self.layers_block_type
        if isinstance(rule, bool):
            return rule
        return env.get(rule.switch, rule.default) == rule.when

    def accounting_source(self, env: dict[str, str]) -> str:
        rule = self.layers_block_type
        if isinstance(rule, bool):
            return "layers_block_type"
        return f"layers_block_type, {rule.switch}={env.get(rule.switch, rule.default)}"

    config_fallback: ConfigFallback | None = Field(
        default=None, description="What preflight builds the config as when the served model's config classes come "
        "from a source that is not available here (the vendor's config checks still run; the architecture is not "
        "checked, and the report says so)")


class Source(Strict):
    """A pinned upstream the recipe builds on (the model adapter), and what it is known to add.

    Deploys name its files as `@name/path`. With a local checkout (`path`, or `--source name=PATH`) the
    pinned commit is exported from it and bundled into the submission; without one, `toolkit build` clones the
    URL into its cache (once), verifies the pinned commit and bundles the same way, unless `fetch` leaves it to
    the image build (which then clones the URL and verifies the commit: the builder needs git and network, and
    the build, lint and check say so).
    """

    name: str = Field(pattern=ID_PATTERN)
    git: str = Field(description="Repository URL")
    commit: str = Field(pattern=r"^[0-9a-f]{40}$", description="The pinned commit")
    subdir: str | None = Field(default=None, description="The folder of the repository that `@name/path` is "
                               "relative to (e.g. qwen3_6_scripts)")
    path: str | None = Field(default=None, description="Local checkout (relative to the recipe) to bundle from")
    fetch: Literal["host", "host-or-image", "image"] = Field(
        default="host", description="Who fetches it when no local checkout is given: `host`, `toolkit build` clones "
        "it into its cache at the pinned commit and bundles the used files (the image build needs no git and no "
        "network; a host that cannot reach it fails the build); `host-or-image`, the same, but a host that cannot "
        "reach it leaves the clone to the image build; `image`, always the image build (git and network needed in "
        "the platform's builder)")
    digests: str | None = Field(
        default=None, description="A lock file (relative to the recipe, JSON path -> sha256) of the used files at "
        "the pinned commit; the in-image step checks a fetched source against it")

    @field_validator("subdir")
    @classmethod
    def _subdir(cls, value: str | None) -> str | None:
        return None if value is None else relative_path(value.rstrip("/"))
    provides_flags: list[str] = Field(default_factory=list, description="Server flags its CLI module adds")
    provides_tool_parsers: list[str] = Field(default_factory=list)
    registers_multimodal: bool = Field(
        default=False, description="Its model module makes the served architecture multimodal in vLLM's registry: "
        "vLLM takes --limit-mm-per-prompt only then, so preflight checks that flag only where the source's files are")


class Package(Strict):
    """A second package the recipe edits besides the vendor's (e.g. transformers), with roots of its own."""

    name: DottedName = Field(description="The import name, e.g. transformers")
    version: str = Field(description="Version specifier its roots must satisfy, e.g. ==4.55.3")
    install: str | None = Field(
        default=None, description="name==version: the wheel the submission carries and the in-image step installs "
        "offline when the image holds another version")
    roots: list[str] = Field(
        default_factory=list, description="Absolute site-packages folders in the image; empty: found in the image "
        "with importlib.util.find_spec (without importing it), on a host with --package-root NAME=DIR")
    reference: str | None = Field(
        default=None, description="The release (name==version) the build tries the transforms on; default: install")

    _spec = field_validator("version")(Vendor._spec.__func__)  # type: ignore[attr-defined]

    @field_validator("install", "reference")
    @classmethod
    def _pinned(cls, value: str | None) -> str | None:
        return None if value is None else Vendor._pinned.__func__(cls, value)  # type: ignore[attr-defined]

    @property
    def trial_release(self) -> str | None:
        return self.reference or self.install


class Overrides(Strict):
    args: dict[str, ArgValue] = Field(default_factory=dict, description="Serve args to set (null removes one)")
    env: dict[str, str | None] = Field(default_factory=dict, description="Env to set (null removes one)")


class Matrix(Strict):
    args: dict[str, list[ArgValue]] = Field(default_factory=dict, description="Serve arg -> values to try")
    env: dict[str, list[str]] = Field(default_factory=dict, description="Env var -> values to try")


class Checks(Strict):
    lf_only: list[str] = Field(
        default_factory=list, description="Globs (relative to each vendor root) of files that must be LF-only"
    )
    fast_paths_off: str | None = Field(
        default=None, description="The variant that turns every fast path the recipe injects or switches on off (the "
        "adapter's own code at its pin), by env only: the rehearsal's answers are compared with it at TP 1. Unset: "
        "every dispatch switch the recipe adds is set to 0 for that reference (a dispatch that is a fix, not a fast "
        "path, then needs this variant)")


class Estimate(Strict):
    """What `toolkit estimate` needs besides the model: where its layers run, and its device model's constants."""

    layer_region: str = Field(description="The probe region around each decoder layer (its operations are scaled "
                              "from the counted interval to model.num_layers)")
    calibration: str = Field(description="The calibration file (YAML: launch_us, bandwidth_fraction, "
                             "compute_fraction, all_reduce_us, sync_us, and what they were fitted on), relative to "
                             "the recipe file; `toolkit estimate --calibrate DIR` writes one")
    timed_switches: dict[str, str] = Field(
        default_factory=dict, description="Switches the served code resolves by timing candidates on the device it "
        "runs on (`auto`), each with the value the target chooses: the census counts it so where the variant leaves "
        "it unset or `auto` (timed on this CPU, it would count the CPU's fastest path, run by run)")


class Recipe(Strict):
    name: str = Field(pattern=ID_PATTERN)
    description: str = ""
    hardware: Hardware
    base_image: BaseImage
    vendor: Vendor
    patches: str = Field(default="../patches/src", description="The patches folder, relative to the recipe file; "
                         "`toolkit:` is the toolkit's own (native_fastpaths, chat_templates, hybrid_kv_accounting.py), "
                         "as installed with it")
    transforms: list[Transform] = Field(default_factory=list,
                                        description="The code changes (none for a serve-only recipe)")
    env: dict[str, str] = Field(default_factory=dict, description="Environment of the server")
    serve: Serve
    checks: Checks = Field(default_factory=Checks)
    model: ModelShape | None = Field(default=None, description="Model shape, for the KV-cache estimate")
    estimate: Estimate | None = Field(default=None, description="toolkit estimate's layer region and calibration")
    sources: list[Source] = Field(default_factory=list, description="Pinned upstream sources")
    packages: list[Package] = Field(default_factory=list,
                                    description="Packages besides the vendor's that transforms edit")
    variants: dict[str, Overrides] = Field(default_factory=dict, description="Named experiment variants")
    matrix: Matrix | None = Field(default=None, description="Variants expanded as the product of these values")

    @field_validator("variants")
    @classmethod
    def _variant_names(cls, variants: dict[str, Overrides]) -> dict[str, Overrides]:
        for name in variants:
            if not re.match(ID_PATTERN, name) or name == "base":
                raise ValueError(f"variant names are lowercase ids (and not 'base'), got {name!r}")
        return variants

    @model_validator(mode="after")
    def _known_sources(self) -> Recipe:
        names = {s.name for s in self.sources}
        for t in self.transforms:
            tree = t.pinned
            if tree is not None and tree not in names:
                raise ValueError(f"transform {t.id} deploys from @{tree}, which is not declared under sources "
                                 f"(declared: {', '.join(sorted(names)) or 'none'})")
        return self

    @model_validator(mode="after")
    def _known_requirements(self) -> Recipe:
        ids = {t.id for t in self.transforms}
        for t in self.transforms:
            unknown = [r for r in t.requires if r not in ids or r == t.id]
            if unknown:
                raise ValueError(f"transform {t.id} requires {', '.join(unknown)}, which is not another transform "
                                 "of this recipe")
        return self

    @model_validator(mode="after")
    def _known_reference_variant(self) -> Recipe:
        name = self.checks.fast_paths_off
        if name is not None and name not in self.variants:
            raise ValueError(f"checks.fast_paths_off names variant {name!r}, which is not under variants (known: "
                             f"{', '.join(self.variants) or 'none'})")
        if name is not None and (self.variants[name].args or None in self.variants[name].env.values()):
            # it is compared with the served variant: any difference but switches would be another configuration
            raise ValueError(f"checks.fast_paths_off names variant {name!r}, which sets serve args or unsets env: "
                             "the fast-paths-off reference may differ from the served variant in env values only; "
                             f"give {name} only env values")
        return self

    @model_validator(mode="after")
    def _known_packages(self) -> Recipe:
        names = {p.name for p in self.packages}
        if self.vendor.package in names:
            raise ValueError(f"packages lists the vendor package {self.vendor.package}; it is declared by vendor")
        for t in self.transforms:
            if t.package is not None and t.package not in names | {self.vendor.package}:
                raise ValueError(f"transform {t.id} edits package {t.package!r}, which is not declared under "
                                 f"packages (declared: {', '.join(sorted(names)) or 'none'})")
        return self

    def with_expectations(self, expected: dict[str, str]) -> Recipe:
        """The recipe with the `replaces` digests of its replacement deploys taken from a lock (dest -> sha256)."""
        contracts = {t.dest: t for t in self.transforms if isinstance(t, Deploy) and t.replaces is not None}
        unknown = sorted(set(expected) - set(contracts))
        if unknown:
            raise ValueError(f"no replacement deploy has dest {', '.join(unknown)} (known: {', '.join(contracts)})")
        for dest, digest in expected.items():
            if not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise ValueError(f"{dest}: not a sha256: {digest!r}")
        transforms = [t.model_copy(update={"replaces": expected[t.dest]})
                      if isinstance(t, Deploy) and t.dest in expected else t for t in self.transforms]
        return self.model_copy(update={"transforms": transforms})

    def package_of(self, transform: TransformBase) -> str:
        return transform.package or self.vendor.package

    def attention_backend(self) -> str:
        """The backend the server is expected to run: the one its env forces, else the image's default."""
        return str(self.env.get("VLLM_ATTENTION_BACKEND") or self.base_image.attention_backends[0])

    def kernels(self) -> list[Kernels]:
        """The kernels transforms the target applies (built for its hardware.device_arch)."""
        return [t for t in self.transforms if isinstance(t, Kernels) and t.architecture == self.hardware.device_arch]

    def kernel_modules(self) -> list[str]:
        """The dotted names the tree imports the target's prebuilt kernels by (the CPU runtime stands them in)."""
        return [name for t in self.kernels() for name in t.import_names()]

    def for_package(self, name: str) -> list[TransformBase]:
        return [t for t in self.transforms if self.package_of(t) == name]

    def package(self, name: str) -> Package | None:
        return next((p for p in self.packages if p.name == name), None)

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if not re.match(ENV_PATTERN, name):
                raise ValueError(f"not an environment variable name: {name!r}")
        return env


@dataclass(frozen=True)
class LoadedRecipe:
    """A validated recipe plus where it came from (for file:line messages and relative paths)."""

    recipe: Recipe
    path: Path
    located: Located  # the merged recipe: every mark names the file of the layer it came from
    layers: tuple[str, ...] = ()  # the files it is made of, in merge order, the recipe itself last
    # the declared sources' files found on this machine (exported at the pin), by source name: what lint reads of
    # a deployed third-party file; empty until commands.common.pinned resolves them
    found: dict[str, Path] = field(default_factory=dict)

    @property
    def patches_dir(self) -> Path:
        """The recipe's patches folder, relative to it; `toolkit:` is the toolkit's own (for a recipe kept outside
        the checkout: the native fast paths and chat templates it installs with)."""
        if self.recipe.patches == TOOLKIT_PATCHES:
            return resource("patches")
        return (self.path.parent / self.recipe.patches).resolve()

    def patches_folder(self) -> Path:
        """patches_dir for a reader: a recipe whose transforms read patches (a deploy, a body replacement, a
        dispatch's switch table) and whose folder is missing is refused here, naming `patches:`."""
        folder = self.patches_dir
        if not folder.is_dir() and any(t.patch_paths() or t.kind == "dispatch" for t in self.recipe.transforms):
            origin = self.origin("patches")
            raise RecipeError(origin.file if origin else str(self.path), origin.line if origin else None, None,
                              f"patches folder {folder} does not exist", key="patches",
                              hint="`patches:` is relative to the file that declares it; `toolkit:` is the "
                              "toolkit's own patches (native_fastpaths, chat_templates), as installed with it")
        return folder

    def origin(self, *loc: str | int) -> Origin | None:
        """The file (of the layer that declared it) and line of a recipe location, or of its nearest parent."""
        mark = self.located.mark_for(loc)
        return Origin(mark.file or str(self.path), mark.line) if mark else None

    def transform_origin(self, index: int) -> Origin | None:
        return self.origin("transforms", index)

    def where(self, *loc: str | int) -> str:
        """file:line of a recipe location, for messages."""
        return str(self.origin(*loc) or self.path)


def _unwrap(annotation: Any) -> list[Any]:
    """The model classes an annotation can hold (through Optional, list, dict, Annotated)."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType, list, dict):
        out: list[Any] = []
        for arg in typing.get_args(annotation):
            out.extend(_unwrap(arg))
        return out
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def _strip(annotation: Any) -> Any:
    """Drop Annotated and Optional around an annotation."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _strip(args[0])
    return annotation


def _pick_model(annotation: Any, node: Any) -> type[BaseModel] | None:
    models: list[type[BaseModel]] = _unwrap(annotation)
    if len(models) == 1:
        return models[0]
    if isinstance(node, dict) and node.get("kind") in TRANSFORM_MODELS:
        return TRANSFORM_MODELS[node["kind"]]  # the discriminated union: the YAML's own kind decides
    return None


def _model_at(data: Any, loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The model class that owns the mapping at a (cleaned) data location."""
    annotation: Any = Recipe
    node = data
    for part in loc:
        model = _pick_model(annotation, node)
        if model is not None and isinstance(part, str) and part in model.model_fields:
            annotation = model.model_fields[part].annotation
        else:  # a list index or a free dict key: step into the container's item type
            args = typing.get_args(_strip(annotation))
            annotation = args[-1] if args else None
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            node = None
    return _pick_model(annotation, node)


def _clean_loc(data: Any, loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
    """Drop pydantic's synthetic parts (union tags, function-after names) from a location."""
    out: list[str | int] = []
    node = data
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        in_list = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        if (isinstance(node, dict) and part in node) or in_list:
            out.append(part)
            node = node[part]
        elif last and isinstance(node, dict) and isinstance(part, str) and not part.startswith("function-"):
            out.append(part)  # a missing field
        # else: a tag such as 'set-kwarg' or '[key]' that is not in the data
    return tuple(out)


def _format_error(source: str, located: Located, err: Any) -> RecipeError:
    loc = _clean_loc(located.data, tuple(err["loc"]))
    mark = located.mark_for(loc)
    key = ".".join(str(p) for p in loc) or None
    kind = err["type"]
    message = err["msg"].removeprefix("Value error, ")
    hint: str | None = None
    if kind == "extra_forbidden":
        owner = _model_at(located.data, loc[:-1])
        valid = sorted(owner.model_fields) if owner else []
        message = f"unknown key {loc[-1]!r}"
        hint = f"valid keys here: {', '.join(valid)}" if valid else None
    elif kind == "missing":
        parent = located.mark_for(loc[:-1])
        mark = parent
        message = f"missing required key {loc[-1]!r}"
    elif kind == "union_tag_not_found":
        message = f"missing `kind`; known kinds: {', '.join(sorted(TRANSFORM_MODELS))}"
    elif kind == "union_tag_invalid":
        loc = (*loc, "kind")
        mark = located.mark_for(loc)
        key = ".".join(str(p) for p in loc)
        message = f"unknown kind {err['ctx']['tag']!r}"
        hint = f"known kinds: {', '.join(sorted(TRANSFORM_MODELS))}"
    elif "input" in err and isinstance(err["input"], str | int | float | bool):
        message = f"{message} (got {err['input']!r})"
    return error_at(mark, source, message, key=key, hint=hint)


def parse_recipe(text: str, source: str = "<recipe>") -> tuple[Recipe, Located, list[str]]:
    """The recipe in `text` (read from `source`), its includes merged in: the model, the merged marks, and the files
    it is made of (toolkit/layers.py has the rules)."""
    try:
        located = load(text, source)
    except YamlLoadError as exc:
        raise RecipeError(
            source, exc.mark.line if exc.mark else None, exc.mark.column if exc.mark else None, exc.message
        ) from None
    if not isinstance(located.data, dict):
        raise RecipeError(source, 1, 1, "a recipe is a YAML mapping at the top level")
    located, layers = compose(located, source)
    try:
        recipe = Recipe.model_validate(located.data)
    except ValidationError as exc:
        errors = [_format_error(source, located, e) for e in exc.errors()]
        if len(errors) > 1:
            combined = errors[0]
            combined.message = f"{source}: {len(errors)} problems:\n" + "\n".join(f"  {e}" for e in errors)
            combined.hint = None
            raise combined from None
        raise errors[0] from None
    seen: dict[str, int] = {}
    for index, transform in enumerate(recipe.transforms):
        if transform.id in seen:
            mark = located.mark_for(("transforms", index, "id"))
            first = located.mark_for(("transforms", seen[transform.id], "id"))
            raise error_at(
                mark, source, f"duplicate transform id {transform.id!r} (first used by transform "
                f"#{seen[transform.id] + 1}, at {where(first, source)})", key=f"transforms.{index}.id",
                hint="give every transform its own id: the id is also its marker in patched files"
                + (f"; to replace the included one, write `instead_of: {transform.id}` in the later one"
                   if first and mark and first.file != mark.file else ""),
            )
        seen[transform.id] = index
    return recipe, located, layers


def load_recipe(path: str | Path) -> LoadedRecipe:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise RecipeError(str(path), None, None, "recipe file not found") from None
    except OSError as exc:
        raise RecipeError(str(path), None, None, f"cannot read recipe: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise RecipeError(str(path), None, None, f"recipe is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    recipe, located, layers = parse_recipe(text, str(path))
    return LoadedRecipe(recipe, path.resolve(), located, tuple(layers))


def json_schema() -> dict[str, Any]:
    """The recipe's JSON Schema, with what toolkit/layers.py reads before the models do: `include`, a transform's
    `instead_of`, and groups of transforms with shared `defaults` (whose members are checked once merged)."""
    schema = Recipe.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "toolkit recipe"
    schema["properties"][INCLUDE] = {
        "description": "Recipe files (layers) merged under this one, in order: paths relative to this file, or "
        f"{TOOLKIT_LAYER}NAME for a layer the toolkit installs with; this file's own keys come last",
        "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
    item = schema["properties"]["transforms"]["items"]
    for ref in item["discriminator"]["mapping"].values():
        schema["$defs"][ref.rpartition("/")[2]]["properties"][INSTEAD_OF] = {
            "type": "string", "pattern": ID_PATTERN,
            "description": "The id of a transform of an included layer that this one replaces, in its place"}
    schema["$defs"]["TransformGroup"] = {
        "type": "object", "additionalProperties": False, "required": [GROUP_DEFAULTS, "transforms"],
        "description": "Transforms sharing fields: each member takes every field of `defaults` it does not set",
        "properties": {GROUP_DEFAULTS: {"type": "object"},
                       "transforms": {"type": "array", "items": {"type": "object"}}}}
    schema["properties"]["transforms"]["items"] = {"anyOf": [item, {"$ref": "#/$defs/TransformGroup"}]}
    return schema
