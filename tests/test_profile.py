"""Where the time goes (`pytest -k profile`): the probe kind's refusals, the TOOLKIT_PROFILE runtime, `toolkit
profile`, and the flagship's probes through vLLM 0.6.3's own scheduler and model runner on the CPU runtime.

The kind's states, idempotence, drift and markers on real vLLM files are in test_kinds.py (probe-* cases).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import FLAGSHIP, REPO, flagship_data, roots_of, transformers_site
from test_preflight import runtime_env

from toolkit.cli import main
from toolkit.results import State
from toolkit.runtime.env import runtime
from toolkit.testing import check_kind

sys.path.insert(0, str(REPO / "patches" / "src"))
from native_fastpaths import profiling

torch = pytest.importorskip("torch", reason="the runtime's tests use tensors: pip install torch==2.13.0")

MOE = '''"""The adapter's module."""
from __future__ import annotations


class Block:
    def forward(self, hidden_states, router_logits=None):
        """Doc."""
        routed = self._pure_pytorch_experts(hidden_states, router_logits)

        def later(x):
            return self._pure_pytorch_experts(x, x)

        return routed + self._pure_pytorch_experts(hidden_states, router_logits)

    def stream(self, hidden_states):
        yield hidden_states

    async def serve(self, hidden_states):
        return hidden_states
'''


# -- the kind: what it refuses, and the shapes test_kinds does not cover -----------------------------------

@pytest.mark.parametrize(("spec", "words"), [
    ({"scope": "Block.stream", "region": "moe"}, "is a generator"),
    ({"scope": "Block.serve", "region": "moe"}, "is async"),
    ({"scope": "Block.forward", "region": "moe", "bucket": {"tokens": "tokens.shape"}},
     "must be a parameter of Block.forward"),
    ({"scope": "Block.forward", "region": "moe.routed", "calls": "self._pure_pytorch_experts", "bucket": {
        "tokens": "x"}}, "parameters: self, hidden_states, router_logits"),
    ({"scope": "Block.forward", "region": "moe.routed", "calls": "self._pure_pytorch_experts"},
     "found 2 untimed site(s), 0 timed"),  # expect 1, two calls in the function (the nested def's is not one)
    ({"scope": "Block", "region": "moe"}, "is a ClassDef, not a function"),
])
def test_probe_refuses_what_it_cannot_time(spec: dict[str, Any], words: str) -> None:
    from toolkit.engine.evaluate import evaluate
    from toolkit.testing import PROVENANCE
    from toolkit.transforms import edit_kind
    from toolkit.transforms.base import Context
    from toolkit.transforms.probe import Probe

    model = Probe.model_validate({"id": "p", "kind": "probe", "file": "m.py", **PROVENANCE, **spec})
    verdict = evaluate("m.py", MOE.encode(), [edit_kind(model, Context(Path(".")))], None).states[0]
    assert verdict.state is State.DRIFTED and words in verdict.message, verdict.message


def test_probe_calls_skip_nested_defs_and_the_import_lands_after_future() -> None:
    text = check_kind({"kind": "probe", "scope": "Block.forward", "region": "moe.routed", "expect": 2,
                       "calls": "self._pure_pytorch_experts", "bucket": {"tokens": "hidden_states"}}, MOE, None)
    assert text.count("_toolkit_profile.timed('moe.routed', self._pure_pytorch_experts, hidden_states)(") == 2
    assert "            return self._pure_pytorch_experts(x, x)" in text  # the nested def is a scope of its own
    assert text.index("from __future__") < text.index("import native_fastpaths.profiling as _toolkit_profile") \
        < text.index("class Block")


def test_probe_without_its_import_is_drifted_not_applied() -> None:
    spec = {"kind": "probe", "scope": "Block.forward", "region": "moe"}
    text = check_kind(spec, MOE, None)
    without = text.replace("import native_fastpaths.profiling as _toolkit_profile\n", "")
    from toolkit.engine.evaluate import evaluate
    from toolkit.testing import PROVENANCE
    from toolkit.transforms import edit_kind
    from toolkit.transforms.base import Context
    from toolkit.transforms.probe import Probe

    model = Probe.model_validate({"id": "t", "file": "m.py", **PROVENANCE, **spec})
    verdict = evaluate("m.py", without.encode(), [edit_kind(model, Context(Path(".")))], None).states[0]
    assert verdict.state is State.DRIFTED and "no `import native_fastpaths.profiling" in verdict.message


@pytest.mark.parametrize(("bucket", "error"), [
    ({}, "give `tokens`"),
    ({"tokens": "x", "name": "decode"}, "one of them"),
    ({"name": "decode", "edges": {"a": 1}}, "give `tokens` too"),
    ({"tokens": "x", "edges": {"big": 64, "small": 1}}, "must rise"),
    ({"tokens": "x", "edges": {"rest": None, "small": 1}}, "must rise"),
])
def test_probe_bucket_rules_are_checked_when_loaded(bucket: dict[str, Any], error: str) -> None:
    from pydantic import ValidationError

    from toolkit.testing import PROVENANCE
    from toolkit.transforms.probe import Probe

    with pytest.raises(ValidationError, match=error):
        Probe.model_validate({"id": "p", "kind": "probe", "file": "m.py", "scope": "f", "region": "r",
                              "bucket": bucket, **PROVENANCE})


@pytest.mark.parametrize(("spec", "expected"), [
    ({"scope": "ModelRunner.execute_model", "region": "step",
      "bucket": {"tokens": "model_input.attn_metadata.num_prefill_tokens", "edges": {"decode": 0, "prefill": None}}},
     # innermost, under the vendor's own decorators
     "    @dump_input_when_exception(exclude_args=[0], exclude_kwargs=[\"self\"])\n    @_toolkit_profile.probe('step', "
     "tokens='model_input.attn_metadata.num_prefill_tokens', buckets=(('decode', 0), ('prefill', None),))\n"
     "    def execute_model("),
    ({"scope": "ModelRunner.execute_model", "region": "step.model_forward", "calls": "model_executable"},
     "            hidden_or_intermediate_states = _toolkit_profile.timed('step.model_forward', "
     "model_executable)(\n"),
    ({"scope": "ModelRunner.execute_model", "region": "step.prepare",
      "statements": "prefill_meta = model_input.attn_metadata.prefill_metadata\n"
                    "decode_meta = model_input.attn_metadata.decode_metadata"},
     "        with _toolkit_profile.region('step.prepare') if _toolkit_profile.ON else _toolkit_profile.OFF:\n"
     "            prefill_meta = model_input.attn_metadata.prefill_metadata\n"
     "            decode_meta = model_input.attn_metadata.decode_metadata\n"),
], ids=["function", "calls", "statements"])
def test_probe_on_the_real_model_runner(vllm_063: Path, spec: dict[str, Any], expected: str) -> None:
    """check_kind on vLLM 0.6.3's own model_runner.py: planned, idempotent, checked clean; the result compiles."""
    before = (vllm_063 / "vllm/worker/model_runner.py").read_text()
    text = check_kind({"kind": "probe", **spec}, before, None)
    assert expected in text, text[text.find("def execute_model") - 300:][:2500]
    compile(text, "model_runner.py", "exec")


# -- the runtime -----------------------------------------------------------------------------------------

@pytest.fixture
def on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setattr(profiling, "ON", True)
    monkeypatch.setattr(profiling, "DIR", str(tmp_path))
    monkeypatch.setattr(profiling, "EVERY", 0)
    monkeypatch.setattr(profiling, "_stats", {})
    monkeypatch.setattr(profiling, "_notes", [])
    monkeypatch.setattr(profiling, "_stack", [])
    monkeypatch.setattr(profiling, "_summaries", 0)
    monkeypatch.setattr(profiling, "_outermost_calls", 0)
    monkeypatch.setattr(profiling, "_watchers", [])
    return tmp_path


def test_a_watcher_sees_each_outermost_region_start_and_end_from_inside_it(on: Path) -> None:
    seen: list[tuple[str, Any]] = []
    profiling.watch(lambda: seen.append(("enter", profiling.current())),
                    lambda: seen.append(("leave", profiling.current())))
    assert profiling.current() is None
    with profiling.region("step", 1), profiling.region("step.inner"):
        seen.append(("inside", profiling.current()))
    with profiling.region("alone", 5):
        pass
    assert seen == [("enter", ("decode", "step")), ("inside", ("decode", "step.inner")), ("leave", ("decode", "step")),
                    ("enter", ("prefill", "alone")), ("leave", ("prefill", "alone"))]


def test_regions_nest_buckets_follow_tokens_and_inherit(on: Path) -> None:
    @profiling.probe("step", tokens="x")
    def step(x: Any) -> Any:
        with profiling.region("step.inner", x, buckets=(("huge", None),)):  # inside step: step's bucket
            return profiling.timed("step.inner.call", lambda t: t * 2)(x)

    assert step.__name__ == "step"  # functools.wraps: vLLM's signature checks see the function
    step(torch.zeros(1, 4))
    step(torch.zeros(7, 4))
    step(x=torch.zeros(1, 4))
    with profiling.region("alone", 300, buckets=(("decode", 1), ("small", 256), ("long", None))):
        pass
    with profiling.region("fixed", bucket="warmup"):
        pass
    with profiling.region("untyped"):
        pass
    stats = profiling._stats
    assert {k: v[0] for k, v in stats.items()} == {
        ("decode", "step"): 2, ("decode", "step.inner"): 2, ("decode", "step.inner.call"): 2,
        ("prefill", "step"): 1, ("prefill", "step.inner"): 1, ("prefill", "step.inner.call"): 1,
        ("long", "alone"): 1, ("warmup", "fixed"): 1, ("all", "untyped"): 1}
    for bucket in ("decode", "prefill"):
        assert stats[(bucket, "step")][1] >= stats[(bucket, "step.inner")][1] >= stats[(bucket, "step.inner.call")][1]


def test_off_reads_no_clock_and_writes_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(profiling, "ON", False)
    monkeypatch.setattr(profiling, "DIR", str(tmp_path))
    monkeypatch.setattr(profiling, "_stats", {})

    def fn(x: int) -> int:
        return x

    assert profiling.probe("a")(fn) is fn  # nothing added per call
    assert profiling.timed("a", fn) is fn
    assert profiling.region("a") is profiling.OFF
    monkeypatch.setattr(profiling.time, "perf_counter_ns", lambda: pytest.fail("a clock was read"))
    with profiling.region("a", 3):
        fn(1)
    profiling._at_exit()
    assert profiling._stats == {} and list(tmp_path.iterdir()) == []


def test_every_n_writes_cumulative_summaries_the_last_one_counts(on: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 cli) -> None:
    monkeypatch.setattr(profiling, "EVERY", 2)
    for _ in range(5):
        with profiling.region("step", 1), profiling.region("step.forward"):
            pass
    files = list(on.glob("profile-*.jsonl"))
    assert len(files) == 1
    lines = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert [line["summary"] for line in lines] == [1, 1, 2, 2]  # after calls 2 and 4, two regions each
    assert {line["calls"] for line in lines if line["summary"] == 2} == {4}
    profiling.write_summary(final=True)
    result = cli("profile", on, "--json")
    assert result.code == 0, result.err
    assert [(r["region"], r["calls"]) for r in result.json()["buckets"]["decode"]] == [("step", 5),
                                                                                      ("step.forward", 5)]


def test_the_profile_env_is_read_at_import_and_a_bad_value_is_named(tmp_path: Path) -> None:
    code = "import native_fastpaths.profiling as p; print(p.ON, p.SYNC, p.EVERY, p.DIR)"
    env = {"PYTHONPATH": str(REPO / "patches" / "src"), "TOOLKIT_PROFILE": "1", "TOOLKIT_PROFILE_SYNC": "1",
           "TOOLKIT_PROFILE_EVERY": "10", "TOOLKIT_PROFILE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.stdout.split() == ["True", "True", "10", str(tmp_path)], proc.stderr
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(env, TOOLKIT_PROFILE_EVERY="often"))
    assert bad.returncode != 0 and "TOOLKIT_PROFILE_EVERY='often': expected a whole number" in bad.stderr
    for spelling in ("true", "yes", "on"):  # once read as on by a parser of its own; the one reader refuses them
        odd = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=dict(env, TOOLKIT_PROFILE=spelling))
        assert odd.returncode != 0 and f"TOOLKIT_PROFILE={spelling!r}: expected exactly 0 or 1" in odd.stderr


# -- `toolkit profile` -------------------------------------------------------------------------------------

def _record(path: Path, rank: int, summary: int, regions: dict[str, tuple[int, int]], final: bool = True,
            bucket: str = "decode") -> None:
    with path.open("a") as out:
        for region, (calls, total) in regions.items():
            out.write(json.dumps({"pid": 100 + rank, "rank": rank, "summary": summary, "final": final,
                                  "sync": True, "bucket": bucket, "region": region, "calls": calls,
                                  "total_ns": total, "max_ns": total // calls}) + "\n")


def test_profile_merges_ranks_with_shares_and_spread(cli, tmp_path: Path) -> None:
    for rank, all_reduce in ((0, 10_000_000), (1, 30_000_000)):
        path = tmp_path / f"profile-{100 + rank}.jsonl"
        _record(path, rank, 1, {"step": (1, 50_000_000)}, final=False)  # an earlier summary: superseded
        _record(path, rank, 2, {"step": (2, 100_000_000), "step.model_forward": (2, 80_000_000),
                                "step.model_forward.layer.moe.all_reduce": (80, all_reduce)})
    result = cli("profile", tmp_path, "--json")
    assert result.code == 0, result.err
    rows = {r["region"]: r for r in result.json()["buckets"]["decode"]}
    assert list(rows) == ["step", "step.model_forward", "step.model_forward.layer.moe.all_reduce"]
    assert rows["step"]["total_ms"] == 100.0 and rows["step"]["calls"] == 2 and rows["step"]["mean_ms"] == 50.0
    assert rows["step.model_forward"]["share_of_parent"] == 0.8
    reduce_ = rows["step.model_forward.layer.moe.all_reduce"]
    assert reduce_["parent"] == "step.model_forward"  # the nearest recorded ancestor
    assert reduce_["total_ms"] == 20.0 and reduce_["share_of_step"] == 0.2
    assert [(r["rank"], r["total_ms"]) for r in reduce_["ranks"]] == [(0, 10.0), (1, 30.0)]
    human = cli("profile", tmp_path)
    assert "10.00..30.00" in human.out and "layer.moe.all_reduce" in human.out and "TP ranks 0, 1" in human.out


def test_profile_compare_and_plot(cli, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    _record(a / "profile-1.jsonl", 0, 1, {"step": (4, 40_000_000), "step.sample": (4, 8_000_000)})
    _record(b / "profile-2.jsonl", 0, 1, {"step": (4, 30_000_000), "step.sample": (4, 8_000_000)})
    result = cli("profile", "compare", a, b, "--json")
    assert result.code == 0, result.err
    assert {r["region"]: r["total_ratio"] for r in result.json()["buckets"]["decode"]} == {
        "step": 0.75, "step.sample": 1.0}
    pytest.importorskip("matplotlib", reason="the plot needs the plot extra")
    assert cli("profile", a, "--plot", tmp_path / "p.png").code == 0
    drawn = (tmp_path / "p.png").read_bytes()
    assert len(drawn) > 1000
    again = cli("profile", a, "--plot", tmp_path / "p.png")
    assert again.code == 2 and "exists; nothing was written" in again.err
    assert (tmp_path / "p.png").read_bytes() == drawn


def test_a_summary_cut_off_by_a_kill_is_not_taken_for_the_total(on: Path, cli) -> None:
    """A worker killed while it appends summary 2 leaves some of its lines: the complete summary 1 stands."""
    with profiling.region("step", 1), profiling.region("step.forward"):
        pass
    path = Path(profiling.write_summary(final=False) or "")
    with profiling.region("step", 1), profiling.region("step.forward"):
        pass
    complete = path.read_text()
    profiling.write_summary(final=True)
    second = path.read_text()[len(complete):].splitlines()
    assert len(second) == 2
    path.write_text(complete + second[0] + "\n" + second[1][:25])  # one line of summary 2 whole, one cut
    result = cli("profile", on, "--json")
    assert result.code == 0, result.err
    assert [(r["region"], r["calls"]) for r in result.json()["buckets"]["decode"]] == [("step", 1),
                                                                                      ("step.forward", 1)]
    assert any("no final summary" in n for n in result.json()["notes"])


def test_profile_errors_name_the_file_and_line(cli, tmp_path: Path) -> None:
    assert cli("profile", tmp_path / "missing").code == 2
    empty = cli("profile", tmp_path)
    assert empty.code == 2 and "holds no profile-*.jsonl" in empty.err and "TOOLKIT_PROFILE_DIR" in empty.err
    path = tmp_path / "profile-1.jsonl"
    _record(path, 0, 1, {"step": (1, 1_000_000)})
    path.write_text(path.read_text() + '{"pid": 1, "summary": 2, "bucket": "dec')  # killed mid-write
    assert cli("profile", tmp_path).code == 0  # the complete summary before it stands
    path.write_text('garbage\n' + path.read_text())
    bad = cli("profile", tmp_path)
    assert bad.code == 2 and f"{path}:1: not a profile record" in bad.err
    assert cli("profile", "compare", tmp_path).code == 2


# -- the flagship's probes on the CPU runtime ----------------------------------------------------------------

def _harness(tmp: Path, env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run([str(runtime()), str(REPO / "tests" / "runtime_prefix_state.py"), "control"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(json.loads(proc.stdout)["control"])


def test_profile_the_flagship_probes_through_vllms_model_runner(cli, tmp_path: Path, corex_template: Path,
                                                                adapter_args: list[str],
                                                                transformers_455: Path) -> None:
    """vLLM 0.6.3's scheduler and ModelRunner.execute_model over the pinned adapter, patched by the flagship: with
    TOOLKIT_PROFILE=1 every probed region the CPU can reach is recorded, prefill and decode apart, children within
    their parents; the tokens and logits equal the unprofiled run; with it off no record is written."""
    rootfs = tmp_path / "rootfs"
    shutil.copytree(corex_template, rootfs, symlinks=True)
    site = transformers_site(rootfs, transformers_455, full=True)
    assert main(["apply", str(FLAGSHIP), "--rootfs", str(rootfs), *adapter_args, "--package-root",
                 f"transformers={site}"]) == 0
    # a fixed MoE path: `auto` picks by timing, and two equal-result paths may round differently
    env = dict(runtime_env(tmp_path, site, roots_of(rootfs)[1], cpu_device=True), VLLM_ATTENTION_BACKEND="XFORMERS",
               MOE_SMALL_BATCH_VARIANT="gemm")
    off_dir, on_dir = tmp_path / "off", tmp_path / "on"
    unprofiled = _harness(tmp_path, dict(env, TOOLKIT_PROFILE="0", TOOLKIT_PROFILE_DIR=str(off_dir)))
    profiled = _harness(tmp_path, dict(env, TOOLKIT_PROFILE="1", TOOLKIT_PROFILE_DIR=str(on_dir)))
    assert not off_dir.exists()  # off: not even the folder
    assert profiled == unprofiled  # tokens, logit differences and spreads: probing changes nothing served

    declared = {t["region"] for t in flagship_data()["transforms"]
                if t["kind"] == "probe"}
    result = cli("profile", on_dir, "--json")
    assert result.code == 0, result.err
    buckets = result.json()["buckets"]
    assert {"decode", "prefill"} <= set(buckets), list(buckets)
    for bucket in ("decode", "prefill"):
        rows = {r["region"]: r for r in buckets[bucket]}
        probed = {name for name in rows if ".native_" not in name}
        # every declared region, the vendor backend's XFormersImpl.forward included (the adapter's attention is
        # vLLM's Attention layer, whose KV write and decode the CPU references compute), but two this harness's TP 1
        # cannot reach (the rehearsal, at TP 2, reaches both): the MoE block's TP all-reduce (the pinned adapter
        # calls it only when `self.experts.tp_size > 1`) and the packed q/gate/k/v GEMM (only where the TP size
        # exceeds the KV heads, `use_packed_local_qgkv`: the served TP 4 over 2)
        unreached = {"step.model_forward.layer.moe.all_reduce", "step.model_forward.layer.attention.qgkv_proj"}
        assert probed == declared - unreached, (bucket, sorted(probed ^ declared))
        # the native fast paths time themselves inside the probed region that called them
        assert {"step.model_forward.layer.gdn.norm.native_norm_gated",
                "step.model_forward.layer.moe.routed.native_moe_segments"} & set(rows), sorted(rows)
        for row in rows.values():
            if row["parent"]:
                assert row["total_ms"] <= rows[row["parent"]]["total_ms"], (bucket, row)
        assert rows["step"]["share_of_step"] == 1.0
    # a decode step is one token per sequence: its GatedDeltaNet calls see fewer tokens than the prefill's
    print(cli("profile", on_dir).out)  # the table, in the test's output
