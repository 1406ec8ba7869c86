"""The CPU references of the adapter's CoreX kernels at 2f7d5f5 (toolkit/runtime/references/corex_moe.py), each
against the adapter's own PyTorch path for the same operation: the code is read from the adapter's real
`qwen3_5.py` and `paged_attn.py` (tests/pinned_adapter.py's copy of 2f7d5f5) with `ast` and run here, once with
the CoreX branch calling the reference and once with the branch the adapter takes without the kernel. Shapes are
Qwen3.6-35B-A3B's (hidden 2048, 256 experts, top 8, expert width 512 at TP 1 and 128 per rank at TP 4, 16 query
and 2 KV heads of 256) and the edges of each call site's guard. Every parity check is shown failing for a mutant.
"""

from __future__ import annotations

import ast
import functools
import sys
import textwrap
import traceback
import typing
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pinned_adapter import NEWEST_FILES, require

torch = pytest.importorskip("torch", reason="the references are plain torch: pip install torch==2.13.0")
F = torch.nn.functional

from toolkit.runtime.references import corex_moe  # noqa: E402

# -- tolerances -------------------------------------------------------------------------------------------------
# The head RMSNorm, the exact reduce and both gathers are bit-exact by construction: the gathers copy, a half
# widens to float32 exactly, the head norm's squares are exact and the adapter computes the mean and rsqrt in
# PyTorch either way, and the exact reduce rounds each product to half and sums in float32 in expert order, as
# PyTorch's half `*` and `.sum(0)` do on a CPU. Anything but equality is a wrong reference.
EXACT = 0.0
# The direct routed kernel's dot products (2048 long for W13, 128 for W2) accumulate in float32 in a warp's order,
# PyTorch's half matmuls in BLAS order; the float32 sums differ by ~1e-7 relative, and a difference can flip the
# rounding of a half result (gate/up, an expert's output) by one unit in the last place: 2^-10 relative. Those
# flips pass through SiLU, the W2 dot and the 8-way weighted sum; measured over 20 routings: at most 1 fp16 unit
# at the output's scale (2^-10 of the largest |output|'s binade). Four leave room; a wrong half, expert or weight
# is off by ~100%.
DIRECT_UNITS = 4
# The exact reduce's other orders, against serial_float: tree_float only regroups float32 sums of 8 halves (equal
# in every measured case; one unit allowed for a regrouping that crosses a rounding boundary); serial_half rounds
# each of its 7 partial sums to half, half a unit of the partial sum's binade each (measured: up to 2 units).
TREE_UNITS, HALF_SUM_UNITS = 1, 8
FP16_UNIT = 2.0 ** -10  # fp16's spacing relative to a value's binade

HIDDEN, EXPERTS, TOP_K, HEAD_DIM, Q_HEADS, KV_HEADS = 2048, 256, 8, 256, 16, 2
WIDTH = {1: 512, 4: 128}  # the MoE expert width per rank at TP 1 and TP 4
BLOCK_SIZE, KEY_PACK = 16, 8  # vLLM's default block size; 16 bytes of fp16 per key pack
DECODE_THRESHOLD = 32768  # paged_attn.py: BI100_PYTORCH_DECODE_THRESHOLD's default, above which the gather runs


# -- the adapter's code, read from its files and run ------------------------------------------------------------

@functools.cache
def _adapter(name: str) -> tuple[Path, str, ast.Module]:
    path = require(NEWEST_FILES) / name
    text = path.read_text()
    return path, text, ast.parse(text, str(path))


def _one(nodes: list[Any], what: str) -> Any:
    assert len(nodes) == 1, f"expected one {what} in the adapter, found {len(nodes)}"
    return nodes[0]


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _if_on(name: str, file: str = "qwen3_5.py", within: ast.AST | None = None) -> ast.If:
    """The one `if` whose test reads `name`."""
    tree = within if within is not None else _adapter(file)[2]
    return typing.cast(ast.If, _one([n for n in ast.walk(tree) if isinstance(n, ast.If) and name in _names(n.test)],
                                    f"`if` on {name}"))


def _def(name: str, file: str = "qwen3_5.py") -> ast.FunctionDef | ast.ClassDef:
    return typing.cast(ast.FunctionDef | ast.ClassDef, _one(
        [n for n in ast.walk(_adapter(file)[2]) if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name],
        f"def {name}"))


def _body_around(node: ast.stmt, file: str = "qwen3_5.py") -> list[ast.stmt]:
    """The statement list (a block's body or orelse) that holds `node`."""
    for parent in ast.walk(_adapter(file)[2]):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(parent, field, None)
            if isinstance(block, list) and any(stmt is node for stmt in block):
                return block
    raise AssertionError(f"no block holds line {node.lineno}")


def _run(stmts: list[ast.stmt], names: dict[str, Any], file: str = "qwen3_5.py") -> Any:
    """Run the adapter's statements as a function's body over `names` (its globals): what a `return` among them
    returns, else the locals they leave."""
    wrapper = ast.parse("def _block():\n    return locals()\n").body[0]
    assert isinstance(wrapper, ast.FunctionDef)
    wrapper.body[:0] = stmts
    module = ast.fix_missing_locations(ast.Module(body=[wrapper], type_ignores=[]))
    scope = {"torch": torch, "F": F, **names}
    exec(compile(module, str(_adapter(file)[0]), "exec"), scope)
    return scope["_block"]()


def _exec_def(node: ast.FunctionDef | ast.ClassDef, names: dict[str, Any], file: str = "qwen3_5.py",
              text: str | None = None, path: Path | None = None) -> Any:
    """A def or class from its source segment, run at its own line numbers (tracebacks name the adapter's lines)."""
    if text is None or path is None:
        path, text = _adapter(file)[0], _adapter(file)[1]
    segment = ast.get_source_segment(text, node)
    assert segment is not None
    source = "\n" * (node.lineno - 1) + textwrap.dedent(" " * node.col_offset + segment)
    scope: dict[str, Any] = {"torch": torch, "F": F, "nn": torch.nn, **{n: getattr(typing, n) for n in typing.__all__},
                             **names}
    exec(compile(source, str(path), "exec"), scope)
    return scope[node.name]


def _guard(variable: str, names: dict[str, Any], file: str = "qwen3_5.py") -> bool:
    """The call site's guard (`variable = (_USE_COREX_... and a and b ...)`) on these tensors: without the kernel's
    availability flag (taken as on) and without its `.is_cuda` terms, which a CPU tensor fails."""
    assign = _one([n for n in ast.walk(_adapter(file)[2]) if isinstance(n, ast.Assign)
                   and any(isinstance(t, ast.Name) and t.id == variable for t in n.targets)], f"{variable} =")
    assert isinstance(assign.value, ast.BoolOp) and isinstance(assign.value.op, ast.And)
    terms = [t for t in assign.value.values if not (isinstance(t, ast.Attribute) and t.attr == "is_cuda")
             and not (isinstance(t, ast.Name) and t.id.startswith("_USE_COREX_"))]
    expression = ast.fix_missing_locations(ast.Expression(ast.BoolOp(op=ast.And(), values=terms)))
    return bool(eval(compile(expression, str(_adapter(file)[0]), "eval"), {"torch": torch, **names}))


def _module(name: str, **replace: Callable[..., Any]) -> SimpleNamespace:
    """`vllm.<name>` as the CPU runtime hands it to the adapter: the references the registry keys under it (or a
    mutant in their place), each call's name recorded in `.calls` (a parity check with no call compares nothing)."""
    prefix = f"vllm.{name}."
    functions = {key[len(prefix):]: f for key, f in corex_moe.FUNCTIONS.items() if key.startswith(prefix)}
    assert functions, name
    assert set(replace) <= set(functions)
    calls: list[str] = []

    def recorded(function: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            calls.append(function)
            return f(*args)
        return call

    return SimpleNamespace(calls=calls, **{n: recorded(n, f) for n, f in {**functions, **replace}.items()})


def _refuses(*_: Any) -> Any:
    raise AssertionError("the guard let the call through")


def _parity(got: torch.Tensor, want: torch.Tensor, tolerance: float, what: str) -> float:
    """The largest |got - want|; fails above `tolerance` (or on any other dtype or shape)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    error = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    assert error <= tolerance, f"{what}: max |error| {error} > {tolerance}"
    return error


def _direct_tolerance(want: torch.Tensor) -> float:
    return DIRECT_UNITS * FP16_UNIT * 2.0 ** float(torch.floor(torch.log2(want.double().abs().max())))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed), dtype=dtype).mul_(scale)


def _uniform(*shape: int, seed: int, std: float = 1.0, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """For the large tensors (a TP-1 W13 is 2^29 halves): uniform draws are ~4x cheaper than normal ones."""
    bound = std * 3 ** 0.5
    return torch.empty(*shape, dtype=dtype).uniform_(-bound, bound, generator=_gen(seed))


# -- vLLM 0.6.3's pieces the adapter's PyTorch paths call --------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_layers(vllm_063: Path) -> SimpleNamespace:
    """GemmaRMSNorm (the head norm's base) and SiluAndMul's forward_native, from vLLM 0.6.3's own files. The vendor
    comments out GemmaRMSNorm.forward_cuda's torch.compile (toolkit/corexlike.py VENDOR_EDITS), so its forward_cuda
    is forward_native: forward_static on the weight and epsilon."""
    def method(rel: str, cls: str, name: str) -> Any:
        path = vllm_063 / rel
        text = path.read_text()
        owner = _one([n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef) and n.name == cls], cls)
        node = _one([n for n in owner.body if isinstance(n, ast.FunctionDef) and n.name == name], f"{cls}.{name}")
        return _exec_def(node, {}, text=text, path=path)

    forward_native = method("vllm/model_executor/layers/layernorm.py", "GemmaRMSNorm", "forward_native")

    class GemmaRMSNorm:
        def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
            self.weight = torch.zeros(hidden_size)
            self.variance_epsilon = eps

        forward_static = staticmethod(method("vllm/model_executor/layers/layernorm.py", "GemmaRMSNorm",
                                             "forward_static"))
        forward_cuda = forward_native

    silu_and_mul = method("vllm/model_executor/layers/activation.py", "SiluAndMul", "forward_native")
    return SimpleNamespace(GemmaRMSNorm=GemmaRMSNorm, act_fn=functools.partial(silu_and_mul, None))


# -- corex_attn_head_rms_norm: Qwen3_5AttentionHeadRMSNorm.forward_cuda -----------------------------------------

def _head_norm(layers: SimpleNamespace, x: torch.Tensor, weight: torch.Tensor, kernel: SimpleNamespace | None,
               eps: float = 1e-6) -> torch.Tensor:
    """The adapter's head norm on x: through the kernel (the reference module) when `kernel` is given, else with
    the kernel absent (`_USE_COREX_ATTN_HEAD_RMS_NORM` false: GemmaRMSNorm's PyTorch forward)."""
    cls = _exec_def(_def("Qwen3_5AttentionHeadRMSNorm"), {
        "GemmaRMSNorm": layers.GemmaRMSNorm, "_USE_COREX_ATTN_HEAD_RMS_NORM": kernel is not None,
        "_corex_attn_head_rms_norm": kernel})
    norm = cls(HEAD_DIM, eps=eps)
    norm.weight = weight
    return typing.cast(torch.Tensor, norm.forward_cuda(x))


def _check_head_norm(layers: SimpleNamespace, heads: int, kernel: SimpleNamespace, tokens: int = 1,
                     dtype: torch.dtype = torch.float16) -> float:
    x = _randn(tokens, heads, HEAD_DIM, seed=heads, scale=3.0, dtype=dtype)
    weight = _randn(HEAD_DIM, seed=100 + heads, scale=0.3, dtype=dtype)
    return _parity(_head_norm(layers, x, weight, kernel), _head_norm(layers, x, weight, None), EXACT,
                   f"head RMSNorm, {heads} heads")


# q_norm's heads per rank at TP 1 and 4 (16, 4), k_norm's after the rank's KV head is chosen (2, 1)
@pytest.mark.parametrize("heads", [Q_HEADS, Q_HEADS // 4, KV_HEADS, 1])
def test_head_rms_norm_matches_gemma_rms_norm(vllm_layers: SimpleNamespace, heads: int) -> None:
    kernel = _module("corex_attn_head_rms_norm")
    _check_head_norm(vllm_layers, heads, kernel)
    assert kernel.calls == ["prepare", "apply_inverse"]


def test_head_rms_norm_guard_edges(vllm_layers: SimpleNamespace) -> None:
    refusing = _module("corex_attn_head_rms_norm", prepare=_refuses, apply_inverse=_refuses)
    # two tokens and bf16: the guard (x.shape[0] == 1, float16) keeps the kernel out
    _check_head_norm(vllm_layers, Q_HEADS, refusing, tokens=2)
    _check_head_norm(vllm_layers, Q_HEADS, refusing, dtype=torch.bfloat16)
    # the kernel itself takes any number of rows; it refuses bf16, another head size, a strided view
    kernel = _module("corex_attn_head_rms_norm")
    assert kernel.prepare(torch.zeros(2 * Q_HEADS, HEAD_DIM, dtype=torch.float16))[1].shape == (2 * Q_HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match=r"^input must have dtype float16$"):
        kernel.prepare(torch.zeros(1, HEAD_DIM, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"^input must have shape \(rows, 256\)$"):
        kernel.prepare(torch.zeros(1, 128, dtype=torch.float16))
    with pytest.raises(RuntimeError, match=r"^input must be contiguous$"):
        kernel.prepare(torch.zeros(HEAD_DIM, 2, dtype=torch.float16).t())
    converted, weight = torch.zeros(2, HEAD_DIM), torch.zeros(HEAD_DIM, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"^weight must have dtype float16$"):
        kernel.apply_inverse(converted, weight.bfloat16(), torch.ones(2, 1))
    with pytest.raises(RuntimeError, match=r"^input must have dtype float32$"):
        kernel.apply_inverse(converted.half(), weight, torch.ones(2, 1))
    with pytest.raises(RuntimeError, match=r"^inverse must contain one value per row$"):
        kernel.apply_inverse(converted, weight, torch.ones(3, 1))


def test_head_rms_norm_parity_fails_for_weight_instead_of_one_plus_weight(vllm_layers: SimpleNamespace) -> None:
    def apply_inverse(input: torch.Tensor, weight: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        return (input * inverse.reshape(-1, 1) * weight.float()).half()

    with pytest.raises(AssertionError, match=r"max .error"):
        _check_head_norm(vllm_layers, Q_HEADS, _module("corex_attn_head_rms_norm", apply_inverse=apply_inverse))


# -- the MoE block: Qwen3_5MoeSparseBlock._pure_pytorch_experts, one token ---------------------------------------

Weights = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@pytest.fixture(scope="module")
def experts() -> Weights:
    """`experts(tp, dtype)`: (w13, w2) at TP 4 (one rank's 128-wide slices: the direct kernel's only shape) or
    TP 1 (512 wide), made once each."""
    @functools.cache
    def weights(tp: int, dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype != torch.float16:
            return weights(tp)[0].to(dtype), weights(tp)[1].to(dtype)
        return (_uniform(EXPERTS, 2 * WIDTH[tp], HIDDEN, seed=10 + tp, std=0.02),
                _uniform(EXPERTS, HIDDEN, WIDTH[tp], seed=20 + tp, std=0.02))

    return weights


def _moe_names(layers: SimpleNamespace, weights: tuple[torch.Tensor, torch.Tensor],
               dtype: torch.dtype = torch.float16, seed: int = 0) -> dict[str, Any]:
    """What the single-token path reads, from the method's own routing statements (top-k, softmax, eids, ws) over
    one token's random router logits. Every kernel is off (the module absent, as on a machine without the build):
    each test turns on the one site it compares. The fused activation is on, the adapter's default."""
    method = _def("_pure_pytorch_experts")
    w13, w2 = weights
    self = SimpleNamespace(top_k=TOP_K, experts=SimpleNamespace(w13_weight=w13.to(dtype), w2_weight=w2.to(dtype)),
                           act_fn=layers.act_fn)
    names: dict[str, Any] = {
        "self": self, "hidden_states": _randn(1, HIDDEN, seed=seed, dtype=dtype),
        "router_logits": _randn(1, EXPERTS, seed=seed + 1, scale=2.0, dtype=dtype),
        "_USE_COREX_MOE_DIRECT_ROUTED": False, "_USE_COREX_MOE_WEIGHT_GATHER": False,
        "_USE_COREX_MOE_EXACT_REDUCE": False, "_USE_FUSED_MOE_ACTIVATION": True,
        "_corex_moe_direct_routed": None, "_corex_moe_weight_gather": None, "_corex_moe_exact_reduce": None}
    one_token = _if_on("T", within=method)
    routing = [s for s in method.body if s.lineno < one_token.lineno and not isinstance(s, ast.Expr)]
    direct = _if_on("use_corex_direct")
    before_direct = [s for s in one_token.body if s.lineno < direct.lineno]
    return {**names, **_run([*routing, *before_direct], names)}


def _moe_pytorch(names: dict[str, Any]) -> dict[str, Any]:
    """The single-token path from `if use_corex_direct:` on, its branch not taken: the statements that follow it
    (gather or indexing, F.linear, SiLU, bmm, exact reduce or PyTorch sum) with the flags in `names`."""
    direct = _if_on("use_corex_direct")
    following = _body_around(direct)
    return {**names, **_run(following[following.index(direct):], {**names, "use_corex_direct": False})}


def _moe_direct(names: dict[str, Any], kernel: SimpleNamespace) -> torch.Tensor:
    """`if use_corex_direct:` taken: w13, the adapter's act_fn, w2_reduce (the branch returns)."""
    return typing.cast(torch.Tensor, _run([_if_on("use_corex_direct")], {
        **names, "use_corex_direct": True, "_corex_moe_direct_routed": kernel}))


# -- corex_moe_exact_reduce ---------------------------------------------------------------------------------------

def _check_exact_reduce(layers: SimpleNamespace, weights: tuple[torch.Tensor, torch.Tensor], kernel: SimpleNamespace,
                        seed: int = 0) -> float:
    """The exact-reduce `if` on the path's own expert outputs and routing weights: taken (the reference) against
    its else (PyTorch's weighted sum)."""
    names = _moe_pytorch(_moe_names(layers, weights, seed=seed))
    site = _if_on("_USE_COREX_MOE_EXACT_REDUCE", within=_def("_pure_pytorch_experts"))
    taken = _run([site], {**names, "_USE_COREX_MOE_EXACT_REDUCE": True, "_corex_moe_exact_reduce": kernel})["out"]
    not_taken = _run([site], {**names, "_USE_COREX_MOE_EXACT_REDUCE": False})["out"]
    assert kernel.calls == ["serial_float"]
    return _parity(taken, not_taken, EXACT, "exact reduce")


@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_exact_reduce_matches_the_pytorch_weighted_sum(vllm_layers: SimpleNamespace, experts: Weights, tp: int,
                                                       seed: int) -> None:
    _check_exact_reduce(vllm_layers, experts(tp), _module("corex_moe_exact_reduce"), seed)


def test_exact_reduce_other_orders(vllm_layers: SimpleNamespace, experts: Weights) -> None:
    """tree_float sums in another float32 order (equal here to a unit); serial_half rounds every partial sum."""
    names = _moe_pytorch(_moe_names(vllm_layers, experts(4)))
    kernel = _module("corex_moe_exact_reduce")
    expert_out, ws = names["expert_out"], names["ws"]
    want = kernel.serial_float(expert_out, ws)
    unit = FP16_UNIT * 2.0 ** float(torch.floor(torch.log2(want.double().abs().max())))
    _parity(kernel.tree_float(expert_out, ws), want, TREE_UNITS * unit, "tree_float")
    _parity(kernel.serial_half(expert_out, ws), want, HALF_SUM_UNITS * unit, "serial_half")
    # 2048 + 7 x 1: a half sum loses every 1 (2048's spacing is 2), a float sum keeps them and rounds 2055 once
    rows, ones = torch.tensor([2048.0] + [1.0] * 7, dtype=torch.float16).unsqueeze(1), torch.ones(8).half()
    assert kernel.serial_half(rows, ones).item() == 2048.0
    assert kernel.serial_float(rows, ones).item() == kernel.tree_float(rows, ones).item() == 2056.0


def test_exact_reduce_guard_edges(vllm_layers: SimpleNamespace, experts: Weights) -> None:
    names = _moe_pytorch(_moe_names(vllm_layers, experts(4, torch.bfloat16), dtype=torch.bfloat16))
    site = _if_on("_USE_COREX_MOE_EXACT_REDUCE", within=_def("_pure_pytorch_experts"))
    # bf16: the guard (expert_out and ws float16) keeps the kernel out, and the kernel refuses it
    _run([site], {**names, "_USE_COREX_MOE_EXACT_REDUCE": True,
                  "_corex_moe_exact_reduce": _module("corex_moe_exact_reduce", serial_float=_refuses)})
    kernel = _module("corex_moe_exact_reduce")
    with pytest.raises(RuntimeError, match=r"^inputs must have dtype float16$"):
        kernel.serial_float(names["expert_out"], names["ws"])
    rows, ws = torch.zeros(2 * TOP_K, HIDDEN, dtype=torch.float16), torch.zeros(TOP_K, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"^expert_output must have shape \(8, hidden\)$"):
        kernel.serial_float(rows, ws)  # two tokens' outputs
    with pytest.raises(RuntimeError, match=r"^weights must have shape \(8,\)$"):
        kernel.serial_float(rows[:TOP_K], ws.unsqueeze(0))
    with pytest.raises(RuntimeError, match=r"^inputs must be contiguous$"):
        kernel.serial_float(rows[::2], ws)


def test_exact_reduce_parity_fails_without_the_weights(vllm_layers: SimpleNamespace, experts: Weights) -> None:
    def serial_float(expert_output: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return expert_output.float().sum(0, keepdim=True).half()

    with pytest.raises(AssertionError, match=r"max .error"):
        _check_exact_reduce(vllm_layers, experts(4), _module("corex_moe_exact_reduce", serial_float=serial_float))


# -- corex_moe_weight_gather --------------------------------------------------------------------------------------

def _check_weight_gather(layers: SimpleNamespace, weights: tuple[torch.Tensor, torch.Tensor],
                         kernel: SimpleNamespace) -> float:
    """`if use_corex_gather:` taken (the reference) against its else (`w13[eids]`, `w2[eids]`)."""
    names = _moe_names(layers, weights)
    site = _if_on("use_corex_gather")
    taken = _run([site], {**names, "use_corex_gather": True, "_corex_moe_weight_gather": kernel})
    not_taken = _run([site], {**names, "use_corex_gather": False})
    assert kernel.calls == ["gather"]
    return max(_parity(taken[n], not_taken[n], EXACT, f"weight gather {n}") for n in ("w13_sel", "w2_sel"))


@pytest.mark.parametrize("tp", [1, 4])
def test_weight_gather_matches_indexing(vllm_layers: SimpleNamespace, experts: Weights, tp: int) -> None:
    names = _moe_names(vllm_layers, experts(tp))
    assert _guard("use_corex_gather", names)  # the real widths pass the guard at both TPs
    _check_weight_gather(vllm_layers, experts(tp), _module("corex_moe_weight_gather"))


def test_weight_gather_guard_edges(vllm_layers: SimpleNamespace, experts: Weights) -> None:
    names = _moe_names(vllm_layers, experts(4, torch.bfloat16), dtype=torch.bfloat16)
    assert not _guard("use_corex_gather", names)
    gather = _module("corex_moe_weight_gather").gather
    with pytest.raises(RuntimeError, match=r"^w13 must have dtype float16$"):
        gather(names["w13"], names["w2"], names["eids"])
    w13, w2 = experts(4)
    eids = names["eids"]
    with pytest.raises(RuntimeError, match=r"^expert_ids must have dtype int64$"):
        gather(w13, w2, eids.int())
    with pytest.raises(RuntimeError, match=r"^expert_ids must have shape \(8,\)$"):
        gather(w13, w2, eids[:4])
    with pytest.raises(RuntimeError, match=r"^expert_ids must be a contiguous CUDA tensor$"):
        gather(w13, w2, torch.arange(16)[::2])
    with pytest.raises(RuntimeError, match=r"^W13/W2 intermediate dimensions differ$"):
        gather(w13, torch.empty(EXPERTS, HIDDEN, WIDTH[1], dtype=torch.float16), eids)  # a TP-1 W2, a TP-4 W13
    with pytest.raises(RuntimeError, match=r"^w2 must be rank three$"):
        gather(w13, w2[0], eids)


def test_weight_gather_parity_fails_for_experts_out_of_order(vllm_layers: SimpleNamespace, experts: Weights) -> None:
    def gather(w13: torch.Tensor, w2: torch.Tensor, expert_ids: torch.Tensor) -> list[torch.Tensor]:
        ids = expert_ids.sort().values
        return [w13[ids], w2[ids]]

    with pytest.raises(AssertionError, match=r"max .error"):
        _check_weight_gather(vllm_layers, experts(4), _module("corex_moe_weight_gather", gather=gather))


# -- corex_moe_direct_routed --------------------------------------------------------------------------------------

def _check_direct(layers: SimpleNamespace, weights: tuple[torch.Tensor, torch.Tensor], kernel: SimpleNamespace,
                  seed: int = 0) -> float:
    """`if use_corex_direct:` taken (w13, SiLU, w2_reduce) against the path the adapter takes without the kernels
    (indexing, F.linear, SiLU, bmm, PyTorch's weighted sum)."""
    names = _moe_names(layers, weights, seed=seed)
    want = _moe_pytorch(names)["out"]
    got = _moe_direct(names, kernel)
    assert kernel.calls[-2:] == ["w13", "w2_reduce"]
    return _parity(got, want, _direct_tolerance(want), "direct routed")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_direct_routed_matches_the_pytorch_path(vllm_layers: SimpleNamespace, experts: Weights, seed: int) -> None:
    names = _moe_names(vllm_layers, experts(4), seed=seed)
    assert _guard("use_corex_direct", names)
    kernel = _module("corex_moe_direct_routed")
    path = _moe_pytorch(names)
    # each kernel on its own, on the PyTorch path's own inputs
    gate_up = kernel.w13(names["hidden_states"], names["w13"], names["eids"])
    _parity(gate_up, path["gate_up"], _direct_tolerance(path["gate_up"]), "direct w13")
    out = kernel.w2_reduce(path["act"], names["w2"], names["eids"], names["ws"])
    _parity(out, path["out"], _direct_tolerance(path["out"]), "direct w2_reduce")
    _check_direct(vllm_layers, experts(4), kernel, seed)


def test_direct_routed_sums_in_the_warps_order() -> None:
    """What PyTorch parity cannot see: each row's float32 sum in the kernel's order, lane l over the half2 pairs
    l, l + 32, ... (x then y), then the lanes folded by shuffles of 16, 8, 4, 2, 1, written out one float at a time
    (a numpy float32 scalar rounds each add). The values span 2^-8..2^8, so another order rounds differently."""
    np = pytest.importorskip("numpy")
    weight = _randn(3, HIDDEN, seed=5) * torch.exp2(torch.randint(-8, 9, (3, HIDDEN), generator=_gen(6))).half()
    x = _randn(HIDDEN, seed=7)
    products = (weight.float() * x.float()).numpy()
    serial_differs = False
    for row in range(3):
        lanes = [np.float32(0.0)] * 32
        for lane in range(32):
            for pair in range(lane, HIDDEN // 2, 32):
                lanes[lane] = np.float32(lanes[lane] + products[row, 2 * pair])
                lanes[lane] = np.float32(lanes[lane] + products[row, 2 * pair + 1])
        offset = 16
        while offset:
            lanes[:offset] = [np.float32(lanes[i] + lanes[i + offset]) for i in range(offset)]
            offset //= 2
        assert corex_moe._warp_dots(weight[row:row + 1], x).item() == float(lanes[0])
        serial = np.float32(0.0)
        for value in products[row]:
            serial = np.float32(serial + value)
        serial_differs |= serial != lanes[0]
    assert serial_differs  # the data tells orders apart


def test_direct_routed_guard_edges(vllm_layers: SimpleNamespace, experts: Weights) -> None:
    kernel = _module("corex_moe_direct_routed")
    # TP 1's 512-wide experts: the guard takes the gather path, the kernel refuses the shape
    tp1 = (torch.empty(EXPERTS, 2 * WIDTH[1], HIDDEN, dtype=torch.float16),
           torch.empty(EXPERTS, HIDDEN, WIDTH[1], dtype=torch.float16))
    names = _moe_names(vllm_layers, tp1)
    assert not _guard("use_corex_direct", names)
    with pytest.raises(RuntimeError, match=r"^w13 must have shape \(256, 256, 2048\)$"):
        kernel.w13(names["hidden_states"], names["w13"], names["eids"])
    with pytest.raises(RuntimeError, match=r"^w2 must have shape \(256, 2048, 128\)$"):
        kernel.w2_reduce(torch.zeros(TOP_K, WIDTH[4], dtype=torch.float16), names["w2"], names["eids"], names["ws"])
    # two tokens: the guard's hidden_states.shape == (1, 2048) refuses, and so does the kernel
    w13, w2 = experts(4)
    two = {**_moe_names(vllm_layers, experts(4)), "hidden_states": torch.zeros(2, HIDDEN, dtype=torch.float16)}
    assert not _guard("use_corex_direct", two)
    with pytest.raises(RuntimeError, match=r"^input must have shape \(1, 2048\)$"):
        kernel.w13(two["hidden_states"], w13, two["eids"])
    # bf16: refused by the guard and the kernel
    bf16 = _moe_names(vllm_layers, experts(4, torch.bfloat16), dtype=torch.bfloat16)
    assert not _guard("use_corex_direct", bf16)
    with pytest.raises(RuntimeError, match=r"^input must have dtype float16$"):
        kernel.w13(bf16["hidden_states"], w13, bf16["eids"])
    with pytest.raises(RuntimeError, match=r"^weights must have dtype float16$"):
        kernel.w2_reduce(torch.zeros(TOP_K, WIDTH[4], dtype=torch.float16), w2, bf16["eids"], bf16["ws"])
    with pytest.raises(RuntimeError, match=r"^activated must have shape \(8, 128\)$"):
        kernel.w2_reduce(torch.zeros(TOP_K, 2 * WIDTH[4], dtype=torch.float16), w2, bf16["eids"], bf16["ws"].half())


def test_direct_routed_parity_fails_with_silu_on_the_up_half(vllm_layers: SimpleNamespace, experts: Weights) -> None:
    def w13(input: torch.Tensor, w13: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        gate, up = corex_moe.w13(input, w13, expert_ids).chunk(2, dim=-1)
        return torch.cat([up, gate], dim=-1)  # the adapter's act_fn now takes SiLU of up

    with pytest.raises(AssertionError, match=r"max .error"):
        _check_direct(vllm_layers, experts(4), _module("corex_moe_direct_routed", w13=w13))


# -- corex_paged_kv_gather: PagedAttention._forward_decode_pytorch ----------------------------------------------

def _paged(kv_heads: int, seq_len: int, dtype: torch.dtype = torch.float16,
           table_dtype: torch.dtype = torch.int32) -> dict[str, Any]:
    """One decoding sequence of seq_len positions (ending mid-block) in a cache whose blocks are shuffled, beside
    a second, shorter one; query heads at the same GQA ratio as the model's (8 per KV head)."""
    width = max((seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE, 3)
    physical = 2 * width + 3
    order = torch.randperm(physical, generator=_gen(seq_len))
    tables = torch.stack([order[:width], order[width:2 * width]]).to(table_dtype)
    return {"query": _randn(2, kv_heads * Q_HEADS // KV_HEADS, HEAD_DIM, seed=1, dtype=dtype),
            "key_cache": _uniform(physical, kv_heads, HEAD_DIM // KEY_PACK, BLOCK_SIZE, KEY_PACK, seed=2, dtype=dtype),
            "value_cache": _uniform(physical, kv_heads, HEAD_DIM, BLOCK_SIZE, seed=3, dtype=dtype),
            "block_tables": tables, "seq_lens": torch.tensor([seq_len, 2 * BLOCK_SIZE + 1]),
            "scale": HEAD_DIM ** -0.5}


def _gather_site(inputs: dict[str, Any], kernel: SimpleNamespace | None, i: int = 0) -> dict[str, Any]:
    """The decode function's statements up to its sequence loop, then sequence i's up to and through the gather
    `if` (the guard included), with the kernel flag on when `kernel` is given."""
    function = typing.cast(ast.FunctionDef, _def("_forward_decode_pytorch", "paged_attn.py"))
    site = _if_on("use_corex_gather", "paged_attn.py")
    loop = _body_around(site, "paged_attn.py")
    preamble = [s for s in function.body if isinstance(s, ast.Assign)]  # the shapes, GQA ratio, dtype, output
    seq = [s for s in loop if s.lineno <= site.lineno]
    return typing.cast(dict[str, Any], _run([*preamble, *seq], {
        **inputs, "i": i, "_USE_COREX_PAGED_KV_GATHER": kernel is not None, "_corex_paged_kv_gather": kernel},
        "paged_attn.py"))


def _check_paged_gather(inputs: dict[str, Any], kernel: SimpleNamespace) -> float:
    taken, not_taken = _gather_site(inputs, kernel), _gather_site(inputs, None)
    assert taken["use_corex_gather"] and not not_taken["use_corex_gather"] and kernel.calls == ["gather"]
    return max(_parity(taken[n], not_taken[n], EXACT, f"paged gather {n}") for n in ("k_t", "v_t"))


# TP 4: a rank's one KV head; TP 1: both. Just past the PyTorch decode threshold (where the adapter gathers), and
# short contexts that end mid-block
@pytest.mark.parametrize("kv_heads,seq_len", [(1, DECODE_THRESHOLD + 1), (2, DECODE_THRESHOLD + 1), (1, 37),
                                              (2, 1)])
def test_paged_kv_gather_matches_the_pytorch_gather(kv_heads: int, seq_len: int) -> None:
    _check_paged_gather(_paged(kv_heads, seq_len), _module("corex_paged_kv_gather"))


def test_paged_decode_is_the_same_with_the_gather() -> None:
    """The whole PyTorch decode, both sequences, with and without the kernel."""
    decode = _exec_def(_def("_forward_decode_pytorch", "paged_attn.py"),
                       {"sys": sys, "traceback": traceback}, "paged_attn.py")
    inputs = _paged(KV_HEADS, 3 * BLOCK_SIZE + 5)

    def run(kernel: SimpleNamespace | None) -> torch.Tensor:
        decode.__globals__.update(_USE_COREX_PAGED_KV_GATHER=kernel is not None, _corex_paged_kv_gather=kernel)
        return typing.cast(torch.Tensor, decode(**inputs))

    kernel = _module("corex_paged_kv_gather")
    _parity(run(kernel), run(None), EXACT, "paged decode")
    assert kernel.calls == ["gather", "gather"]  # one per sequence


def test_paged_kv_gather_guard_edges() -> None:
    refusing = _module("corex_paged_kv_gather", gather=_refuses)
    # bf16 caches and an int64 block table: the guard takes the PyTorch gather
    assert not _gather_site(_paged(1, 37, dtype=torch.bfloat16), refusing)["use_corex_gather"]
    assert not _gather_site(_paged(1, 37, table_dtype=torch.int64), refusing)["use_corex_gather"]
    gather = _module("corex_paged_kv_gather").gather
    bf16, inputs = _paged(1, 37, dtype=torch.bfloat16), _paged(1, 37)
    table = inputs["block_tables"][0]
    with pytest.raises(RuntimeError, match=r"^key_cache must have dtype float16$"):
        gather(bf16["key_cache"], bf16["value_cache"], table, 37)
    with pytest.raises(RuntimeError, match=r"^block_table must have dtype int32$"):
        gather(inputs["key_cache"], inputs["value_cache"], table.long(), 37)
    with pytest.raises(RuntimeError, match=r"^block_table is too short for seq_len$"):
        gather(inputs["key_cache"], inputs["value_cache"], table[:2], 37)
    with pytest.raises(RuntimeError, match=r"^seq_len must be positive$"):
        gather(inputs["key_cache"], inputs["value_cache"], table, 0)
    with pytest.raises(RuntimeError, match=r"^key/value KV-head counts differ$"):
        gather(_paged(2, 37)["key_cache"], inputs["value_cache"], table, 37)
    with pytest.raises(RuntimeError, match=r"^block_table must be a one-dimensional row$"):
        gather(inputs["key_cache"], inputs["value_cache"], inputs["block_tables"], 37)


def test_paged_kv_gather_parity_fails_for_blocks_in_table_order_reversed() -> None:
    def gather(key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
               seq_len: int) -> list[torch.Tensor]:
        blocks = (seq_len + value_cache.shape[3] - 1) // value_cache.shape[3]
        return corex_moe.paged_kv_gather(key_cache, value_cache, block_table[:blocks].flip(0).contiguous(), seq_len)

    with pytest.raises(AssertionError, match=r"max .error"):
        _check_paged_gather(_paged(1, 37), _module("corex_paged_kv_gather", gather=gather))
