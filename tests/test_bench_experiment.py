"""`toolkit experiment` on the real CPU server: every variant started with its run config's argv and env,
measured, archived and stopped; nothing started beside a leftover; an interrupt stops what it started."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import fake_tools
import pytest
from conftest import REPO

from toolkit.bench import cpu_server
from toolkit.bench.serve import free_port, port_in_use, stray_processes

RECIPE = REPO / "tests" / "recipes" / "cpu-server.yaml"


@pytest.fixture(scope="module")
def cpu_env() -> tuple[Path, Path]:
    python = cpu_server.environment()
    return python, cpu_server.tiny_model(python)


def test_experiment_measures_each_variant_and_leaves_nothing(cli: Any, cpu_env: tuple[Path, Path],
                                                            tmp_path: Path) -> None:
    python, model = cpu_env
    assert stray_processes() == []
    out = tmp_path / "exp"
    result = cli("experiment", RECIPE, "--all-variants", "--python", python, "--model", model, "--workload",
                 "short", "--requests", "4", "--max-tokens", "16", "--ignore-eos", "--concurrency", "1,2",
                 "-o", out, "--json")
    assert result.code == 0, result.err + result.out
    variants = {v["variant"]: v for v in result.json()["variants"]}
    assert set(variants) == {"base", "seqs1"}
    for name, v in variants.items():
        assert v["status"] == "measured", v
        assert [run["success_rate"] for run in v["runs"]] == [1.0, 1.0]
        assert (out / name / "server.log").is_file() and (out / name / "bench" / "c2" / "summary.json").is_file()
        run = json.loads((out / name / "bench" / "c1" / "run.json").read_text())
        argv = run["argv"]
        assert argv[argv.index("--max-num-seqs") + 1] == ("1" if name == "seqs1" else "4")
        if len(os.sched_getaffinity(0)) > 1:  # vLLM-CPU binds its worker to a core: the client ran on the others
            assert run["client_cores"] and len(run["client_cores"]) < len(os.sched_getaffinity(0)), run
    assert (out / "experiment.png").is_file()
    assert stray_processes() == [], "no server or worker process outlives the experiment"


def test_experiment_monitors_each_variant_and_checks_the_devices_first(cli: Any, cpu_env: tuple[Path, Path],
                                                                      tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With a (fake) nvidia-smi listing two cards, the CPU server's Python runs no kernel on them: the start is
    refused, the devices named; without the check each variant is measured with the devices sampled, and --profile
    adds a profiled run beside the scores (this server's code carries no probe: the note says so)."""
    python, model = cpu_env
    monkeypatch.setenv("PATH", fake_tools.path_with(fake_tools.install(tmp_path / "bin", "nvidia-smi",
                                                                       fake_tools.NVIDIA_IDLE)))
    refused = cli("experiment", RECIPE, "--python", python, "--model", model, "-o", tmp_path / "sick")
    assert refused.code == 2, refused.err
    assert "refusing to start variant base: nvidia-smi lists device(s) 0, 1 that the serving Python does not see" \
        in refused.err and "--no-device-check" in refused.err
    out = tmp_path / "exp"
    result = cli("experiment", RECIPE, "--python", python, "--model", model, "--requests", "3", "--max-tokens", "16",
                 "--ignore-eos", "--no-device-check", "--profile", "2", "-o", out, "--json")
    assert result.code == 0, result.err + result.out
    base = result.json()["variants"][0]
    assert base["runs"][0]["monitor"]["devices"]["0"]["memory_used_mib_max"] == 100.0
    assert (out / "base" / "bench" / "c1" / "monitor.csv").is_file()
    assert base["health"] == "device health not checked: --no-device-check"
    assert "the server's code carries no probe" in base["profile"]["note"]
    assert (out / "base" / "profile" / "bench" / "c1" / "summary.json").is_file()  # kept apart from the scores
    assert [run["run_folder"] for run in base["runs"]] == [str(out / "base" / "bench" / "c1")]
    assert stray_processes() == []


def test_experiment_refuses_to_start_beside_a_leftover(cli: Any, cpu_env: tuple[Path, Path],
                                                       tmp_path: Path) -> None:
    python, model = cpu_env
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                              "vllm.entrypoints.openai.api_server"], start_new_session=True)
    # a script that only imports from vllm.entrypoints is no server
    script = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)  # vllm.entrypoints.openai.protocol"],
                              start_new_session=True)
    try:
        result = cli("experiment", RECIPE, "--python", python, "--model", model, "-o", tmp_path / "exp")
        assert result.code == 2 and "stray server/worker process" in result.err and str(decoy.pid) in result.err
        assert str(script.pid) not in result.err
    finally:
        for process in (decoy, script):
            process.kill()
            process.wait()


def _as_a_foreground_job() -> None:
    """Ctrl-C's SIGINT as a terminal's foreground job receives it. A suite started in the background by a shell
    without job control (`bash .ci/run > log &` in a script) runs with SIGINT ignored, every child inherits that, and
    Python then installs no KeyboardInterrupt handler: the CLI rightly ignored the interrupt, which is what failed
    here under such a run (reproduced with `bash -c 'pytest ... & wait'`), not the experiment."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_an_interrupted_experiment_stops_the_server_it_started(cpu_env: tuple[Path, Path],
                                                               tmp_path: Path) -> None:
    python, model = cpu_env
    out = tmp_path / "exp"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "toolkit.cli", "experiment", str(RECIPE), "--python", str(python),
                             "--model", str(model), "--port", str(port), "--requests", "20000", "--max-tokens",
                             "64", "-o", str(out)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_as_a_foreground_job)
    deadline = time.monotonic() + 240
    try:
        # the bench's staging folder exists from its first request until it is renamed whole at the end; 20,000
        # requests are hours of this CPU server's work, so the interrupt lands inside the run on any machine
        while not any(out.glob("base/.bench.partial.*")):
            assert not (out / "base" / "bench").exists(), "the run finished before it could be interrupted"
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the server never became ready"
            time.sleep(0.5)
        assert port_in_use(port) and stray_processes()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        # whatever failed, hours of requests must not go on beside the rest of the suite (a run left behind once
        # made every later server test refuse to start beside it): a second interrupt, then the end
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
        # and the server it started, with its workers (its own process group), so that this test's failure is not
        # every later server test's "refusing to start beside a running server"
        for line in stray_processes():
            pid = int(line.split(":", 1)[0])
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
                if "--port" in argv and argv[argv.index("--port") + 1:][:1] == [str(port)]:
                    os.killpg(pid, signal.SIGKILL)
    assert proc.returncode == 130, err.decode()
    assert b"Traceback" not in err
    assert stray_processes() == [] and not port_in_use(port), "the interrupt stopped its server and workers"


USERLAND_TAG = "toolkit-test/userland:latest"


def test_experiment_runs_each_variant_in_an_image_with_docker_run(cli: Any, cpu_env: tuple[Path, Path],
                                                                   engine: Any, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`--image`: the variant's exact argv in a container (host network, the model at /model), measured, its log
    kept, the container stopped and removed; a labelled container left running refuses the next start."""
    from toolkit.bench.serve import CONTAINER_LABEL
    from toolkit.testing import make_userland_image

    python, model = cpu_env
    make_userland_image(USERLAND_TAG)
    venv = python.parent.parent
    mounts = [f"{venv}:{venv}", f"{sys.base_prefix}:{sys.base_prefix}", "/usr:/usr"]  # the CPU server's userland
    args = ["--image", USERLAND_TAG, "--python", python, "--model", model,
            *[item for m in mounts for item in ("--mount", m)]]
    out = tmp_path / "exp"
    result = cli("experiment", RECIPE, *args, "--workload", "short", "--requests", "4", "--max-tokens", "16",
                 "--ignore-eos", "--concurrency", "1", "-o", out, "--json")
    assert result.code == 0, result.err + result.out
    [variant] = result.json()["variants"]
    assert variant["status"] == "measured" and [r["success_rate"] for r in variant["runs"]] == [1.0], variant
    run = json.loads((out / "base" / "bench" / "c1" / "run.json").read_text())
    assert run["image"] == USERLAND_TAG and run["argv"][run["argv"].index("--model") + 1] == "/model"
    assert "Application startup complete" in (out / "base" / "server.log").read_text()  # the container's log, kept
    assert engine.containers.list(all=True, filters={"label": CONTAINER_LABEL}) == []
    assert stray_processes() == []
    # a device tool that lists two cards: the kernel check runs in the image, whose torch sees none
    plain_path = os.environ["PATH"]
    monkeypatch.setenv("PATH", fake_tools.path_with(fake_tools.install(tmp_path / "bin", "nvidia-smi",
                                                                       fake_tools.NVIDIA_IDLE)))
    sick = cli("experiment", RECIPE, *args, "-o", tmp_path / "sick")
    assert sick.code == 2 and "refusing to start variant base: nvidia-smi lists device(s) 0, 1 that the serving " \
        "Python does not see (it ran on none)" in sick.err, sick.err
    assert engine.containers.list(all=True, filters={"label": CONTAINER_LABEL}) == []  # the check's, removed
    monkeypatch.setenv("PATH", plain_path)
    leftover = engine.containers.run(USERLAND_TAG, ["sleep", "120"], detach=True, labels={CONTAINER_LABEL: "decoy"},
                                     volumes={"/usr": {"bind": "/usr", "mode": "ro"}})
    try:
        refused = cli("experiment", RECIPE, *args, "-o", tmp_path / "again")
        assert refused.code == 2 and f"container left running {leftover.short_id}" in refused.err, refused.err
    finally:
        leftover.remove(force=True)
