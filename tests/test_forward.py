"""The plain forward (toolkit/rehearsal/forward.py) on the flagship's tiny checkpoint, rewritten as other checkpoints
lay out the same weights: the answers must not move. A checkpoint it cannot read is one oracle fewer, said, never the
end of the rehearsal."""

from __future__ import annotations

import subprocess
import types
from pathlib import Path

import pytest
from conftest import FLAGSHIP

from toolkit.inputs import cache_dir
from toolkit.pyenv import code
from toolkit.recipe import load_recipe
from toolkit.rehearsal.checks.answers import plain_answers
from toolkit.rehearsal.forward import reference_answers
from toolkit.rehearsal.oracles import Answer, Prompt
from toolkit.runtime import tiny_model
from toolkit.runtime.env import runtime

PROMPTS = [Prompt("a", (11, 42, 7, 99, 3)), Prompt("b", (5, 17, 250, 8))]
TOKENS = 6

# run in the CPU runtime (torch, safetensors): argv = source folder, target folder, how to rewrite it
REWRITE = r"""
import json, shutil, sys
from pathlib import Path
from safetensors.torch import load_file, save_file

source, target, how = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
shutil.copytree(source, target)
w = load_file(str(source / "model.safetensors"))
layers = json.loads((source / "config.json").read_text())["text_config"]["num_hidden_layers"]
text = "model.language_model."
if how == "per-expert":  # a text-only model's prefix and one tensor per expert, as older MoE checkpoints are
    out = {}
    for name, t in w.items():
        if name.endswith("experts.gate_up_proj"):
            stem = "model." + name.removeprefix(text).removesuffix("gate_up_proj")
            for e, fused in enumerate(t):
                gate, up = fused.chunk(2, dim=0)
                out[f"{stem}{e}.gate_proj.weight"], out[f"{stem}{e}.up_proj.weight"] = gate.clone(), up.clone()
        elif name.endswith("experts.down_proj"):
            stem = "model." + name.removeprefix(text).removesuffix("down_proj")
            for e, down in enumerate(t):
                out[f"{stem}{e}.down_proj.weight"] = down.clone()
        else:
            out["model." + name.removeprefix(text) if name.startswith(text) else name] = t
    w = out
if how in ("half-shared", "dense"):  # the routed experts give 0 and the shared gate 0.5: half the shared expert
    for i in range(layers):
        p = f"{text}layers.{i}.mlp."
        w[p + "experts.down_proj"] = w[p + "experts.down_proj"] * 0
        w[p + "shared_expert_gate.weight"] = w[p + "shared_expert_gate.weight"] * 0
if how == "dense":  # the same half of the shared expert as one dense MLP, no router
    for i in range(layers):
        p = f"{text}layers.{i}.mlp."
        shared = {part: w.pop(f"{p}shared_expert.{part}.weight") for part in ("gate_proj", "up_proj", "down_proj")}
        for name in [n for n in w if n.startswith(p)]:
            del w[name]
        w[p + "gate_proj.weight"], w[p + "up_proj.weight"] = shared["gate_proj"], shared["up_proj"]
        w[p + "down_proj.weight"] = shared["down_proj"] * 0.5
if how == "no-final-norm":
    del w[text + "norm.weight"]
save_file({k: v.contiguous() for k, v in w.items()}, str(target / "model.safetensors"))
"""


@pytest.fixture(scope="module")
def checkpoint() -> tuple[Path, Path]:
    python = runtime()
    spec = tiny_model.tiny_spec(load_recipe(FLAGSHIP).recipe.model, 2)
    return python, tiny_model.build(spec, python, cache_dir() / "tiny-models")


def rewritten(python: Path, model: Path, target: Path, how: str) -> Path:
    proc = subprocess.run(code(python, REWRITE, str(model), str(target), how), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return target


def same(got: list[Answer], want: list[Answer]) -> None:
    assert [a.ids for a in got] == [a.ids for a in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)


def test_the_same_weights_laid_out_otherwise_give_the_same_answers(checkpoint: tuple[Path, Path],
                                                                   tmp_path: Path) -> None:
    python, model = checkpoint
    served = reference_answers(python, model, PROMPTS, TOKENS, 3)
    assert all(len(a.ids) == TOKENS for a in served)
    # the text-only prefix and one tensor per expert: the same model
    same(reference_answers(python, rewritten(python, model, tmp_path / "split", "per-expert"), PROMPTS, TOKENS, 3),
         served)
    # a dense MLP that is half the shared expert, against the mixture made to give exactly that
    half = reference_answers(python, rewritten(python, model, tmp_path / "half", "half-shared"), PROMPTS, TOKENS, 3)
    assert [a.ids for a in half] != [a.ids for a in served]  # the rewrite changed the model: the check means something
    same(reference_answers(python, rewritten(python, model, tmp_path / "dense", "dense"), PROMPTS, TOKENS, 3), half)
    # the checkpoint is read once and each prompt starts from empty caches: the second answer is the one it has alone
    same(reference_answers(python, model, PROMPTS[1:], TOKENS, 3), served[1:])


def test_a_checkpoint_it_cannot_read_is_an_oracle_fewer_said(checkpoint: tuple[Path, Path], tmp_path: Path) -> None:
    python, model = checkpoint
    broken = rewritten(python, model, tmp_path / "broken", "no-final-norm")
    answers, why = plain_answers(types.SimpleNamespace(python=python, model=broken), PROMPTS)  # type: ignore[arg-type]
    assert answers is None
    assert why.startswith(f"the plain forward of {broken} failed: KeyError: 'norm.weight'"), why
    assert why.endswith("the answers are not compared outside vLLM"), why
