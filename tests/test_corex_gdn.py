"""The CPU references of the adapter's CoreX Gated DeltaNet kernels at 2f7d5f5 (toolkit/runtime/references/
corex_gdn.py) against the adapter's own PyTorch path for the same operation, both run from the real
`qwen3_6_scripts/qwen3_5.py`: nothing of the adapter is re-typed here. The decode of `GatedDeltaNet.forward` is
executed statement by statement from the file's syntax tree (its prelude, then the decode `else:` block up to a
call site); at a call site `if <guard>: <kernel call> else: <PyTorch>` the `body` runs with the reference bound to
the kernel's module name and the `orelse` runs as the adapter does without the kernel, on the same inputs, and
what each assigns is compared (and the in-place states). The guards themselves are evaluated from the file too,
so each case says whether the adapter would call the kernel at all.

Shapes are Qwen3.6-35B-A3B's linear attention (16 key heads and 32 value heads of 128, conv kernel 4) at TP 1 and
one rank of TP 4, batch 1 and 2, fp16, and bf16 where a guard lets it through. Each reference also has a mutant
(one deliberate slip) that the same comparison rejects.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import re
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the references are plain torch: pip install torch==2.13.0")

import torch.nn.functional as F  # noqa: E402
from pinned_adapter import NEWEST_FILES, require  # noqa: E402

from toolkit.runtime.references import corex_gdn  # noqa: E402

Names = dict[str, Any]

# -- the adapter's code, from its syntax tree -----------------------------------------------------------------------


class Adapter:
    """`qwen3_5.py` parsed once; statements are compiled from its own nodes, so a traceback names its lines."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.source = path.read_text(encoding="utf-8")
        self.tree = ast.parse(self.source, filename=str(path))

    def _only(self, found: list[Any], what: str) -> Any:
        assert len(found) == 1, f"{len(found)} {what} in {self.path}"
        return found[0]

    def function(self, name: str, cls: str | None = None) -> ast.FunctionDef:
        scope: ast.AST = self.tree
        if cls is not None:
            scope = self._only([n for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef) and n.name == cls],
                               f"class {cls}")
        body = scope.body if isinstance(scope, ast.Module | ast.ClassDef) else []
        return self._only([n for n in body if isinstance(n, ast.FunctionDef) and n.name == name], f"def {name}")

    def define(self, name: str, names: Names, cls: str | None = None) -> Callable[..., Any]:
        """The function (or method, unbound) with `names` as its globals, as the module would define it."""
        self.run([self.function(name, cls)], names)
        return names.pop(name)  # type: ignore[no-any-return]

    def guarded(self, variable: str, scope: ast.AST) -> ast.If:
        """The `if <variable>:` inside scope (the call site of one kernel)."""
        return self._only([n for n in ast.walk(scope) if isinstance(n, ast.If) and isinstance(n.test, ast.Name)
                           and n.test.id == variable], f"`if {variable}:`")

    def index(self, block: list[ast.stmt], text: str) -> int:
        """Which top-level statement of block contains text (exactly one must)."""
        found = [i for i, stmt in enumerate(block) if text in ast.unparse(stmt)]
        return self._only(found, f"statements with {text!r}")  # type: ignore[no-any-return]

    def run(self, statements: list[ast.stmt], names: Names) -> Names:
        code = compile(ast.Module(body=statements, type_ignores=[]), str(self.path), "exec")
        exec(code, names)
        return names

    @functools.cached_property
    def forward(self) -> ast.FunctionDef:
        return self.function("forward", cls="GatedDeltaNet")

    @functools.cached_property
    def decode(self) -> list[ast.stmt]:
        """The decode branch of GatedDeltaNet.forward: the orelse of `if is_prefill:`."""
        return self.guarded("is_prefill", self.forward).orelse


@pytest.fixture(scope="module")
def adapter() -> Adapter:
    return Adapter(require(NEWEST_FILES) / "qwen3_5.py")


@contextlib.contextmanager
def _no_timer(name: str) -> Iterator[None]:
    yield


class Spy:
    """A kernel module stand-in: its entry point `name` runs `function` (the reference or a mutant), counted."""

    def __init__(self, name: str, function: Callable[..., Any]) -> None:
        self.calls = 0
        self._function = function
        setattr(self, name, self._call)

    def _call(self, *args: Any) -> Any:
        self.calls += 1
        return self._function(*args)


# -- the model's shapes ---------------------------------------------------------------------------------------------

NUM_K_HEADS, NUM_V_HEADS, HEAD_DIM, CONV_KERNEL = 16, 32, 128, 4  # Qwen3.6-35B-A3B's linear attention


@dataclass(frozen=True)
class Case:
    tp: int
    batch: int
    dtype: torch.dtype = torch.float16
    seed: int = 0

    def __str__(self) -> str:
        return f"tp{self.tp}-b{self.batch}-{str(self.dtype).removeprefix('torch.')}"


CASES = [Case(tp, batch) for tp in (4, 1) for batch in (1, 2)]
BF16 = [Case(4, 1, torch.bfloat16), Case(1, 2, torch.bfloat16)]

# each kernel module (vllm.corex_gdn_<module>) and its one pybind entry point
ENTRY_POINTS = {"causal_conv": "causal_conv_update", "gated_norm": "apply_inverse", "beta_decay": "beta_decay",
                "qk_map": "qk_map", "packed_decode": "packed_decode"}


def _prelude(adapter: Adapter, case: Case, on: str | None = None,
             kernels: dict[str, Callable[..., Any]] | None = None) -> Names:
    """GatedDeltaNet.forward run up to `if is_prefill:` on a decode batch (the in-projection is seeded noise), with
    the CoreX flag of `on` set (its guard then says whether the adapter would call it) and every other flag off;
    `kernels` binds the kernels' module names (default: the references, each behind a Spy)."""
    g = torch.Generator().manual_seed(case.seed)
    tp, dtype = case.tp, case.dtype
    nk, nv = NUM_K_HEADS // tp, NUM_V_HEADS // tp
    conv_dim = (2 * nk + nv) * HEAD_DIM

    def noise(*shape: int, scale: float = 1.0, dt: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dt)

    projected = noise(case.batch, conv_dim + nv * HEAD_DIM + 2 * nv, scale=1.5)
    # softplus's threshold (x > 20: x itself) crossed both ways in the decay input, its last two columns
    projected[:, -2:] = torch.tensor([30.0, -30.0], dtype=dtype)
    self = SimpleNamespace(
        layer_idx=3, num_k_heads=NUM_K_HEADS, num_v_heads=NUM_V_HEADS, head_k_dim=HEAD_DIM, head_v_dim=HEAD_DIM,
        key_dim=NUM_K_HEADS * HEAD_DIM, value_dim=NUM_V_HEADS * HEAD_DIM,
        conv_dim=(2 * NUM_K_HEADS + NUM_V_HEADS) * HEAD_DIM, conv_kernel_size=CONV_KERNEL,
        head_expand_ratio=NUM_V_HEADS // NUM_K_HEADS,
        conv1d_weight=noise(conv_dim, 1, CONV_KERNEL, scale=0.5),
        A_log=(torch.rand(nv, generator=g) * 3.0 - 0.5).to(dtype), dt_bias=noise(nv),
        in_proj_qkvzba=lambda hidden_states: (projected, None))
    references = {module: getattr(corex_gdn, entry) for module, entry in ENTRY_POINTS.items()}
    references.update(kernels or {})
    names: Names = {
        "torch": torch, "F": F, "Optional": typing.Optional, "bi100_timer": _no_timer,
        "get_tensor_model_parallel_world_size": lambda: tp,
        "self": self, "hidden_states": torch.zeros(case.batch, 0, dtype=dtype),
        "attn_metadata": SimpleNamespace(num_prefill_tokens=0),
        # float32 (the adapter's mamba cache), deliberately not fp16-representable: the kernels read it through fp16
        "conv_state": torch.randn(case.batch, conv_dim, CONV_KERNEL - 1, generator=g),
        "temporal_state": torch.randn(case.batch, nv, HEAD_DIM, HEAD_DIM, generator=g) * 0.2,
    }
    for module, entry in ENTRY_POINTS.items():
        names[f"_USE_COREX_GDN_{module.upper()}"] = module == on
        names[f"_corex_gdn_{module}"] = Spy(entry, references[module])
    for function in ("_l2norm", "_torch_causal_conv1d_update"):
        names[function] = adapter.define(function, names)
    norm = SimpleNamespace(weight=(1.0 + torch.randn(HEAD_DIM, generator=g) * 0.2).to(dtype), variance_epsilon=1e-6)
    for method in ("forward", "forward_decode"):
        setattr(norm, method, functools.partial(adapter.define(method, names, cls="Qwen3_5RMSNormGated"), norm))
    self.norm = norm
    body = adapter.forward.body
    return adapter.run(body[:adapter.index(body, "if is_prefill")], names)


def _upto(adapter: Adapter, names: Names, block: list[ast.stmt], text: str) -> ast.stmt:
    """Runs block up to (not including) the statement containing text, and returns that statement."""
    at = adapter.index(block, text)
    adapter.run(block[:at], names)
    return block[at]


def _both(adapter: Adapter, names: Names, site: ast.stmt) -> tuple[Names, Names]:
    """The call site's kernel branch and its PyTorch branch, each on its own copy of the in-place states."""
    assert isinstance(site, ast.If)
    runs = []
    for branch in (site.body, site.orelse):
        copy = dict(names, conv_state=names["conv_state"].clone(), temporal_state=names["temporal_state"].clone())
        runs.append(adapter.run(branch, copy))
    return runs[0], runs[1]


def _compare(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> float:
    """The largest |got - want| / (1 + |want|), asserted <= tol; same shape and dtype first."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    got64, want64 = got.double(), want.double()
    assert torch.isfinite(got64).all() and torch.isfinite(want64).all(), f"{what}: non-finite values"
    error = float(((got64 - want64).abs() / (1.0 + want64.abs())).max())
    assert error <= tol, f"{what}: max error {error:.3g} > {tol:.3g}"
    return error


# Tolerances, in max |kernel - PyTorch| / (1 + |PyTorch|): relative for large values, absolute near zero, so one
# fp16 step of any value is under 2**-10. "measured": the largest over seeds 0-2 (packed: 0-19) and the cases here.
# The conv rounds to fp16 where the PyTorch path does (the state read, the conv, the SiLU) and its fp16 x fp16
# products are exact in float32; torch's fp16 conv1d and SiLU could still land one fp16 step off (measured: 0)
CONV_TOL = 2**-10
# the gated norm: the same three float32 products in the same order and one fp16 rounding; only the SiLU's
# float32 formula differs (x / (1 + e**-x) against x * sigmoid(x)), by a last bit that can move that rounding one
# fp16 step (measured: 0)
GATED_NORM_TOL = 2**-10
# beta is the same fp16-rounded sigmoid on both sides; the decay is float32 exp(-exp(A) * softplus) of the same
# float32 numbers, apart only in exp/log1p's last bits: two float32 steps at 1 (measured: 2.4e-8)
BETA_DECAY_TOL = 2**-23
# the kernel path normalises the key heads and then repeats them, the PyTorch path repeats and then normalises:
# the same fp16 _l2norm of the same numbers, except that torch's fp16 rsqrt on a CPU rounds by the tensor's size
# (7 of 16 inverse norms one fp16 step from those of the same 16 repeated to 32), which moves a component of the
# unit q or k by up to 2**-10 (measured: 3.7e-4 at TP 1, 0 at TP 4)
QK_MAP_TOL = 2**-10
# the packed kernel L2-normalises q and k in fp16 with every partial sum of squares rounded (a pairwise tree),
# where _l2norm sums the fp16 squares in float32 and rounds once: 16% of q and k components one fp16 step apart,
# which the float32 recurrence carries into the output and the state (measured: 7.9e-4; with _l2norm's fp16
# norm in the reference instead, 8e-8: the rest of the recurrence agrees to float32)
PACKED_DECODE_TOL = 2 * 2**-10


# -- corex_gdn_causal_conv ------------------------------------------------------------------------------------------

def _conv_parity(adapter: Adapter, case: Case, kernel: Callable[..., Any] = corex_gdn.causal_conv_update,
                 contiguous: bool = False) -> float:
    """The call site `if _USE_COREX_GDN_CAUSAL_CONV:` (kernel) against its `else:` (_torch_causal_conv1d_update):
    the convolved tokens and the shifted conv state. `contiguous`: the token as a contiguous copy (at batch 2
    the call site hands the kernel a strided view, which it refuses)."""
    names = _prelude(adapter, case, "causal_conv", {"causal_conv": kernel})
    site = _upto(adapter, names, adapter.decode, "_corex_gdn_causal_conv.causal_conv_update")
    if contiguous:
        names["mixed_qkv"] = names["mixed_qkv"].contiguous()
    corex, pytorch = _both(adapter, names, site)
    assert corex["_corex_gdn_causal_conv"].calls == 1
    return max(_compare(corex["mixed_qkv_conv"], pytorch["mixed_qkv_conv"], CONV_TOL, "conv output"),
               _compare(corex["conv_state"], pytorch["conv_state"], CONV_TOL, "conv state"))


@pytest.mark.parametrize("case", [c for c in CASES if c.batch == 1], ids=str)
def test_causal_conv_matches_the_adapters_pytorch_conv(adapter: Adapter, case: Case) -> None:
    _conv_parity(adapter, case)


@pytest.mark.parametrize("case", [c for c in CASES if c.batch == 2], ids=str)
def test_causal_conv_at_batch_2(adapter: Adapter, case: Case) -> None:
    # the guard is the flag alone, and at batch 2 the call site's token is a strided view of the projection
    with pytest.raises(RuntimeError, match=r"^hidden must be contiguous$"):
        _conv_parity(adapter, case)
    # the kernel itself computes a batch: handed a contiguous token it agrees
    _conv_parity(adapter, case, contiguous=True)


def test_causal_conv_state_in_place(adapter: Adapter) -> None:
    names = _prelude(adapter, Case(4, 1), "causal_conv")
    site = _upto(adapter, names, adapter.decode, "_corex_gdn_causal_conv.causal_conv_update")
    before, token = names["conv_state"].clone(), names["mixed_qkv"]
    corex, pytorch = _both(adapter, names, site)
    assert torch.equal(corex["conv_state"], pytorch["conv_state"])
    # shifted one column left, the newest token last (widened from fp16); the oldest column is gone
    assert torch.equal(corex["conv_state"][..., 2], token[..., 0].float())
    assert torch.equal(corex["conv_state"][..., :2], before[..., 1:].half().float())


@pytest.mark.parametrize("case", BF16, ids=str)
def test_causal_conv_bf16_reaches_the_kernel_which_refuses_it(adapter: Adapter, case: Case) -> None:
    names = _prelude(adapter, case, "causal_conv")
    site = _upto(adapter, names, adapter.decode, "_corex_gdn_causal_conv.causal_conv_update")
    assert isinstance(site, ast.If)
    pytorch = adapter.run(site.orelse, dict(names))
    assert pytorch["mixed_qkv_conv"].dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match=r"^hidden must have dtype float16$"):
        adapter.run([site], dict(names))  # the whole `if`: its guard is the flag, which is on


def _conv_state_not_shifted(state: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return corex_gdn.causal_conv_update(state.clone(), hidden, weight)


def test_causal_conv_parity_rejects_a_state_left_unshifted(adapter: Adapter) -> None:
    with pytest.raises(AssertionError, match="conv state"):
        _conv_parity(adapter, Case(4, 1), _conv_state_not_shifted)


# -- corex_gdn_gated_norm -------------------------------------------------------------------------------------------

def _gated_norm_run(adapter: Adapter, case: Case, on: bool,
                    kernel: Callable[..., Any] = corex_gdn.apply_inverse) -> Names:
    """The decode through the PyTorch recurrence, then `normed = self.norm.forward_decode(core_out..., z...)` as the
    adapter calls it, with the gated-norm flag on (its guard decides) or off."""
    names = _prelude(adapter, case, "gated_norm" if on else None, {"gated_norm": kernel})
    at = adapter.index(adapter.decode, "self.norm.forward_decode")
    adapter.run(adapter.decode[:at + 1], names)
    return names


def _gated_norm_parity(adapter: Adapter, case: Case, kernel: Callable[..., Any] = corex_gdn.apply_inverse) -> float:
    corex, pytorch = _gated_norm_run(adapter, case, True, kernel), _gated_norm_run(adapter, case, False)
    assert corex["_corex_gdn_gated_norm"].calls == 1  # the guard admitted it
    return _compare(corex["normed"], pytorch["normed"], GATED_NORM_TOL, "gated norm")


@pytest.mark.parametrize("case", CASES, ids=str)
def test_gated_norm_matches_the_adapters_forward(adapter: Adapter, case: Case) -> None:
    _gated_norm_parity(adapter, case)


@pytest.mark.parametrize("case", BF16, ids=str)
def test_gated_norm_bf16_stays_on_pytorch(adapter: Adapter, case: Case) -> None:
    names = _gated_norm_run(adapter, case, True)
    assert names["_corex_gdn_gated_norm"].calls == 0  # the guard wants an fp16 gate and weight
    assert names["normed"].dtype == torch.bfloat16
    rows = names["z"].reshape(-1, HEAD_DIM)
    with pytest.raises(RuntimeError, match=r"^gate must have dtype float16$"):
        corex_gdn.apply_inverse(torch.ones(rows.shape), rows, names["self"].norm.weight, torch.ones(rows.shape[0]))


def _gated_norm_ungated(input: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                        inverse: torch.Tensor) -> torch.Tensor:
    return (weight.float() * (input * inverse.reshape(-1, 1))).half()


def test_gated_norm_parity_rejects_a_missing_silu_gate(adapter: Adapter) -> None:
    with pytest.raises(AssertionError, match="gated norm"):
        _gated_norm_parity(adapter, Case(4, 1), _gated_norm_ungated)


# -- corex_gdn_beta_decay -------------------------------------------------------------------------------------------

def _recurrent_block(adapter: Adapter, names: Names) -> list[ast.stmt]:
    """Runs the decode up to `if use_corex_packed_decode:` (its guard included) and returns its orelse: the
    adapter's per-step recurrence with its own two kernel sites."""
    site = _upto(adapter, names, adapter.decode, "_corex_gdn_packed_decode.packed_decode")
    assert isinstance(site, ast.If)
    return site.orelse


def _beta_decay_site(adapter: Adapter, case: Case, kernel: Callable[..., Any] = corex_gdn.beta_decay) -> \
        tuple[Names, ast.stmt]:
    names = _prelude(adapter, case, "beta_decay", {"beta_decay": kernel})
    site = _upto(adapter, names, _recurrent_block(adapter, names), "_corex_gdn_beta_decay.beta_decay")
    return names, site


def _beta_decay_parity(adapter: Adapter, case: Case, kernel: Callable[..., Any] = corex_gdn.beta_decay) -> float:
    names, site = _beta_decay_site(adapter, case, kernel)
    # at batch 2 the guard refuses the strided views of the projection; the kernel computes a batch when handed
    # contiguous ones
    names.update(b_all=names["b_all"].contiguous(), a_all=names["a_all"].contiguous())
    corex, pytorch = _both(adapter, names, site)
    return max(_compare(corex["bt"], pytorch["bt"], BETA_DECAY_TOL, "beta"),
               _compare(corex["g_t"], pytorch["g_t"], BETA_DECAY_TOL, "decay"))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_beta_decay_matches_the_adapters_sigmoid_and_softplus(adapter: Adapter, case: Case) -> None:
    names, _ = _beta_decay_site(adapter, case)
    assert names["use_corex_beta_decay"] is (case.batch == 1)  # contiguous b_all and a_all: batch 1 only
    _beta_decay_parity(adapter, case)


@pytest.mark.parametrize("case", BF16, ids=str)
def test_beta_decay_bf16_stays_on_pytorch(adapter: Adapter, case: Case) -> None:
    names, _ = _beta_decay_site(adapter, case)
    assert names["use_corex_beta_decay"] is False
    self = names["self"]
    with pytest.raises(RuntimeError, match=r"^beta_input must have dtype float16$"):
        corex_gdn.beta_decay(names["b_all"].contiguous(), names["a_all"].contiguous(), self.A_log, self.dt_bias)


def _beta_decay_without_softplus(beta_input: torch.Tensor, decay_input: torch.Tensor, a_log: torch.Tensor,
                                 dt_bias: torch.Tensor) -> torch.Tensor:
    out = corex_gdn.beta_decay(beta_input, decay_input, a_log, dt_bias)
    out[1] = torch.exp(-torch.exp(a_log.float()) * (decay_input.float() + dt_bias.float()))
    return out


def test_beta_decay_parity_rejects_a_missing_softplus(adapter: Adapter) -> None:
    with pytest.raises(AssertionError, match="decay"):
        _beta_decay_parity(adapter, Case(4, 1), _beta_decay_without_softplus)


# -- corex_gdn_qk_map -----------------------------------------------------------------------------------------------

def _qk_map_site(adapter: Adapter, case: Case, kernel: Callable[..., Any] = corex_gdn.qk_map) -> \
        tuple[Names, ast.stmt]:
    names = _prelude(adapter, case, "qk_map", {"qk_map": kernel})
    site = _upto(adapter, names, _recurrent_block(adapter, names), "_corex_gdn_qk_map.qk_map")
    return names, site


def _qk_map_parity(adapter: Adapter, case: Case, kernel: Callable[..., Any] = corex_gdn.qk_map) -> float:
    names, site = _qk_map_site(adapter, case, kernel)
    corex, pytorch = _both(adapter, names, site)
    return max(_compare(corex["q_t"], pytorch["q_t"], QK_MAP_TOL, "query"),
               _compare(corex["k_t"], pytorch["k_t"], QK_MAP_TOL, "key"))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_qk_map_matches_the_adapters_repeat_and_scale(adapter: Adapter, case: Case) -> None:
    names, _ = _qk_map_site(adapter, case)
    # q_raw and k_raw are strided views at batch 2; the kernel gets _l2norm's (contiguous) results either way
    assert names["use_corex_qk_map"] is (case.batch == 1)
    _qk_map_parity(adapter, case)


@pytest.mark.parametrize("case", BF16, ids=str)
def test_qk_map_bf16_stays_on_pytorch(adapter: Adapter, case: Case) -> None:
    names, _ = _qk_map_site(adapter, case)
    assert names["use_corex_qk_map"] is False
    with pytest.raises(RuntimeError, match=r"^query must have dtype float16$"):
        corex_gdn.qk_map(names["q_raw"].contiguous(), names["k_raw"].contiguous(), NUM_V_HEADS // case.tp)


def test_qk_map_checks() -> None:
    query = torch.zeros(1, 4, HEAD_DIM, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"^value_heads must be divisible by key_heads$"):
        corex_gdn.qk_map(query, query, 6)
    with pytest.raises(RuntimeError, match=r"^key must have shape \(batch, key_heads, 128\)$"):
        corex_gdn.qk_map(query, torch.zeros(1, 4, 64, dtype=torch.float16), 8)
    with pytest.raises(RuntimeError, match=r"^query and key shapes must match$"):
        corex_gdn.qk_map(query, torch.zeros(2, 4, HEAD_DIM, dtype=torch.float16), 8)


def _qk_map_unscaled(query: torch.Tensor, key: torch.Tensor, value_heads: int) -> torch.Tensor:
    out = corex_gdn.qk_map(query, key, value_heads)
    out[0] = query.float().repeat_interleave(value_heads // query.shape[1], dim=1)
    return out


def test_qk_map_parity_rejects_a_missing_query_scale(adapter: Adapter) -> None:
    with pytest.raises(AssertionError, match="query"):
        _qk_map_parity(adapter, Case(4, 1), _qk_map_unscaled)


# -- corex_gdn_packed_decode ----------------------------------------------------------------------------------------

PACKED = Case(4, 1)  # the only shape the kernel is compiled for: one sequence, one rank of TP 4


def _packed_parity(adapter: Adapter, case: Case, kernel: Callable[..., Any] = corex_gdn.packed_decode,
                   pytorch_kernels: tuple[str, ...] = ()) -> float:
    """`if use_corex_packed_decode:` (kernel) against its orelse (the adapter's recurrence, with the beta_decay and
    qk_map references in it where `pytorch_kernels` names them): the output and the recurrent state after."""
    names = _prelude(adapter, case, "packed_decode", {"packed_decode": kernel})
    for module in pytorch_kernels:
        names[f"_USE_COREX_GDN_{module.upper()}"] = True
    site = _upto(adapter, names, adapter.decode, "_corex_gdn_packed_decode.packed_decode")
    assert names["use_corex_packed_decode"] is True
    corex, pytorch = _both(adapter, names, site)
    for module in pytorch_kernels:
        assert pytorch[f"_corex_gdn_{module}"].calls == 1
    return max(_compare(corex["core_out"], pytorch["core_out"], PACKED_DECODE_TOL, "packed output"),
               _compare(corex["temporal_state"], pytorch["temporal_state"], PACKED_DECODE_TOL, "packed state"))


@pytest.mark.parametrize("pytorch_kernels", [(), ("beta_decay", "qk_map")], ids=["pytorch", "with-corex-maps"])
@pytest.mark.parametrize("seed", [0, 1])
def test_packed_decode_matches_the_adapters_recurrence(adapter: Adapter, seed: int,
                                                       pytorch_kernels: tuple[str, ...]) -> None:
    _packed_parity(adapter, Case(4, 1, seed=seed), pytorch_kernels=pytorch_kernels)


def test_packed_decode_state_in_place(adapter: Adapter) -> None:
    names = _prelude(adapter, PACKED, "packed_decode")
    site = _upto(adapter, names, adapter.decode, "_corex_gdn_packed_decode.packed_decode")
    before = names["temporal_state"].clone()
    corex, pytorch = _both(adapter, names, site)
    # the call site keeps no return value but the output: the state handed in is the updated state
    assert corex["_corex_gdn_packed_decode"].calls == 1
    assert not torch.equal(corex["temporal_state"], before)
    _compare(corex["temporal_state"], pytorch["temporal_state"], PACKED_DECODE_TOL, "packed state")


@pytest.mark.parametrize("case,message", [
    (Case(1, 1), r"^state must have shape \(1, 8, 128, 128\)$"),  # TP 1: 16 key / 32 value heads
    (Case(4, 2), r"^state must have shape \(1, 8, 128, 128\)$"),  # two sequences
    (Case(4, 1, torch.bfloat16), "^mixed_qkv must have dtype float16$"),
], ids=["tp1", "batch2", "bf16"])
def test_packed_decode_guard_keeps_what_the_kernel_refuses(adapter: Adapter, case: Case, message: str) -> None:
    names = _prelude(adapter, case, "packed_decode")
    site = _upto(adapter, names, adapter.decode, "_corex_gdn_packed_decode.packed_decode")
    assert names["use_corex_packed_decode"] is False
    assert isinstance(site, ast.If)
    with pytest.raises(RuntimeError, match=message):
        adapter.run(site.body, dict(names))


def test_packed_decodes_l2_norm_is_the_kernels_fp16_tree() -> None:
    """What PACKED_DECODE_TOL absorbs, checked on its own against the kernel's loop written out in numpy's fp16
    (one thread's square per column, the shared-memory tree by stride, the float32 rsqrt rounded to fp16)."""
    np = pytest.importorskip("numpy")
    raw = (torch.randn(4, HEAD_DIM, generator=torch.Generator().manual_seed(5)) * 1.5).half()
    got = corex_gdn._half_l2_normalized(raw)
    for head, normalized in zip(raw.numpy(), got, strict=True):
        squares = [x * x for x in head]
        stride = HEAD_DIM // 2
        while stride > 0:
            for column in range(stride):
                squares[column] = squares[column] + squares[column + stride]
            stride //= 2
        total = np.float32(squares[0] + np.float16(1e-6))
        inverse = np.float16(np.float32(1.0) / np.sqrt(total))
        want = torch.from_numpy(np.array([x * inverse for x in head], dtype=np.float16)).float()
        assert torch.equal(normalized, want)


def test_packed_decode_one_sequence_only() -> None:
    state = torch.zeros(1, 8, HEAD_DIM, HEAD_DIM)
    half = functools.partial(torch.zeros, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"^packed decode only supports one sequence$"):
        corex_gdn.packed_decode(state, half(2, 2048), half(2, 8), half(2, 8), half(8), half(8))
    with pytest.raises(RuntimeError, match=r"^a_log must have shape \(8\)$"):
        corex_gdn.packed_decode(state, half(1, 2048), half(1, 8), half(1, 8), half(16), half(8))


def _packed_state_transposed(state: torch.Tensor, mixed_qkv: torch.Tensor, beta_input: torch.Tensor,
                             decay_input: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    swapped = state.transpose(2, 3).contiguous()  # k_dim and v_dim swapped in the update
    out = corex_gdn.packed_decode(swapped, mixed_qkv, beta_input, decay_input, a_log, dt_bias)
    state.copy_(swapped.transpose(2, 3))
    return out


def test_packed_decode_parity_rejects_a_transposed_state(adapter: Adapter) -> None:
    with pytest.raises(AssertionError, match="packed"):
        _packed_parity(adapter, PACKED, _packed_state_transposed)


# -- the registry ---------------------------------------------------------------------------------------------------

def test_every_pybind_entry_point_has_a_reference(adapter: Adapter) -> None:
    defined = set()
    for module in ENTRY_POINTS:
        cu = (adapter.path.parent / f"corex_gdn_{module}.cu").read_text(encoding="utf-8")
        defined |= {f"vllm.corex_gdn_{module}.{fn}" for fn in re.findall(r'module\.def\(\s*"(\w+)"', cu)}
    assert set(corex_gdn.FUNCTIONS) == defined
    for name, function in corex_gdn.FUNCTIONS.items():
        assert name.endswith("." + function.__name__)
