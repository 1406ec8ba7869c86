"""A server's lifecycle: refuse to start beside leftovers, start in its own process group, wait until it serves,
stop the whole group (SIGTERM, wait, SIGKILL); what a device monitor says is left behind."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from toolkit.bench.monitor import Monitor
from toolkit.errors import ToolkitError

# what a vLLM server or one of its workers looks like in a process table
# the servers' own modules, not every script that imports from vllm.entrypoints (a preflight stage, a test's
# request check): those are not servers, and end by themselves
SERVER_MARKERS = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.api_server", "vllm serve", "EngineCore",
                  "VllmWorker", "multiproc_worker")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _running(pid: int) -> int | None:
    """The process group of a process still running; None when it is gone or a zombie (it has ended and holds no
    core or memory, only its entry until its parent, or init once the parent is gone, reaps it: up to 1.5 s here
    after a server's stop). Its state and group read from one /proc/PID/stat."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, _parent, group = stat[stat.rfind(")") + 2:].split(" ", 3)[:3]
    return None if state in ("Z", "X") else int(group)


def stray_processes(exclude: set[int] | None = None) -> list[str]:
    """Server or worker processes still running on this machine ("pid: command")."""
    exclude = (exclude or set()) | {os.getpid()}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in exclude or _running(int(entry.name)) is None:
            continue
        pid = int(entry.name)
        text = _cmdline(pid) + " " + process_name(pid)
        if any(marker in text for marker in SERVER_MARKERS):
            found.append(f"{pid}: {text[:160]}")
    return found


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PORT_FLOOR = 20000  # below it: the ports people configure by hand


def _ephemeral_low() -> int:
    """Where the kernel's ephemeral ports begin."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A port free now, for a server that binds it seconds later. Outside the kernel's ephemeral range: a port
    from bind(0) is one the kernel also hands any outgoing connection as its source port meanwhile (a server that
    died with EADDRINUSE beside a busy client was the symptom); random, so two callers at once rarely meet."""
    low = _ephemeral_low()
    if low - PORT_FLOOR >= 1000:
        for port in random.SystemRandom().sample(range(PORT_FLOOR, low), 64):
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # no room below the range: the kernel's pick
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def leftovers(port: int, monitor: Monitor | None = None, gpu_memory_mib: float = 1024.0) -> list[str]:
    """Everything that would make a new server look worse than it is: strays, a taken port, GPU memory held."""
    problems = [f"stray server/worker process {p}" for p in stray_processes()]
    problems += [f"container left running {c}" for c in stray_containers()]
    if port_in_use(port):
        problems.append(f"port {port} is already taken")
    if monitor is not None and monitor.available:
        used = monitor.memory_used_mib()
        if used is not None and used > gpu_memory_mib:
            problems.append(f"{used:.0f} MiB of device memory held with no server of ours running ({monitor.tool})")
    return problems


class Lifecycle:
    """What every way of running a server shares: wait until it serves, failing fast when it exits."""

    url: str
    model: str
    log_path: Path

    def start(self) -> None:
        raise NotImplementedError

    def exited(self) -> int | None:
        """The exit code once the server has exited, else None."""
        raise NotImplementedError

    def log_tail(self, lines: int = 30) -> str:
        raise NotImplementedError

    def stop(self, grace_s: float = 30.0) -> float:
        raise NotImplementedError

    def client_cores(self) -> set[int] | None:
        return None

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until /health is 200 and /v1/models lists the model; fails fast if the server exits."""
        started = time.monotonic()
        # one client for the whole wait: each module-level httpx call builds a client and loads the CA bundle again,
        # about 20 ms of CPU a poll taken from the server that is starting
        with httpx.Client() as client:
            while time.monotonic() - started < timeout_s:
                code = self.exited()
                if code is not None:
                    raise ToolkitError(f"the server exited with code {code} before it was ready; its log ends:\n"
                                       f"{self.log_tail()}", hint=f"the whole log: {self.log_path}")
                try:
                    health = client.get(self.url + "/health", timeout=2)
                    if health.status_code == 200:
                        models = client.get(self.url + "/v1/models", timeout=5).json()
                        if any(m.get("id") == self.model for m in models.get("data", [])):
                            return time.monotonic() - started
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(0.5)
        tail = self.log_tail()
        self.stop()
        raise ToolkitError(f"the server was not ready after {timeout_s:.0f} s (stopped); its log ends:\n{tail}",
                           hint=f"raise --start-timeout, or read the whole log: {self.log_path}")


@dataclass
class Server(Lifecycle):
    """A server run here, in its own process group."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path
    log_path: Path
    url: str
    model: str = "llm"
    process: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self._log = log
        self.process = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)

    def exited(self) -> int | None:
        return self.process.poll() if self.process is not None else None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def client_cores(self) -> set[int] | None:
        return client_cores(self.process.pid) if self.process is not None else None

    def stop(self, grace_s: float = 30.0) -> float:
        """SIGTERM to the process group, wait, SIGKILL what is left; seconds it took."""
        started = time.monotonic()
        process = self.process
        if process is None:
            return 0.0
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        # workers that outlived the leader still belong to its group
        deadline = time.monotonic() + grace_s
        while _group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _group_alive(process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
        self.process = None
        return time.monotonic() - started


CONTAINER_LABEL = "toolkit.experiment"


@dataclass
class ContainerServer(Lifecycle):
    """A server run in an image with `docker run` (the Docker SDK): the host's network (the server listens on the
    loopback port it is given), the model folder at /model, the host's IPC namespace (vLLM's shared memory),
    labelled so a leftover is recognised; stopping it stops the container and removes it, its log kept."""

    image: str
    argv: list[str]
    env: dict[str, str]
    model_dir: Path
    log_path: Path
    url: str
    model: str = "llm"
    mounts: list[str] = field(default_factory=list)  # HOST:CONTAINER, read-only
    devices: list[str] = field(default_factory=list)
    gpus: bool = False
    writable: list[str] = field(default_factory=list)  # HOST:CONTAINER the server writes into (profile records)
    container: Any = None

    def _run(self, command: list[str]) -> Any:
        import docker

        from toolkit.submission.image import client

        volumes = {str(self.model_dir): {"bind": "/model", "mode": "ro"}}
        for mount, mode in [*((m, "ro") for m in self.mounts), *((m, "rw") for m in self.writable)]:
            host, _, inside = mount.partition(":")
            volumes[host] = {"bind": inside or host, "mode": mode}
        requests = [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])] if self.gpus else None
        return client().containers.run(
            self.image, command=command, environment=self.env, network_mode="host", ipc_mode="host",
            volumes=volumes, devices=self.devices or None, device_requests=requests, detach=True,
            labels={CONTAINER_LABEL: self.url})

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.container = self._run(self.argv)

    def kernel_check(self, timeout_s: float) -> tuple[int | None, str, str]:
        """The device kernel check (toolkit.bench.monitor.KERNEL_CHECK) by the image's Python, in a container
        configured as the server's will be (devices, GPUs, mounts); removed after."""
        from toolkit.bench.monitor import KERNEL_CHECK

        container = self._run([self.argv[0], "-c", KERNEL_CHECK])
        try:
            try:
                code: int | None = int(container.wait(timeout=timeout_s).get("StatusCode", 1))
            except Exception:  # the engine's wait timed out: the kernel did not finish
                code = None
            out = container.logs(stdout=True, stderr=False).decode("utf-8", "replace")
            err = container.logs(stdout=False, stderr=True).decode("utf-8", "replace")
        finally:
            container.remove(force=True)
        return code, out, err

    def exited(self) -> int | None:
        if self.container is None:
            return None
        self.container.reload()
        if self.container.status in ("exited", "dead"):
            return int(self.container.attrs.get("State", {}).get("ExitCode", 1))
        return None

    def log_tail(self, lines: int = 30) -> str:
        if self.container is None:
            return "(no container)"
        return str(self.container.logs(tail=lines).decode("utf-8", "replace")).rstrip()

    def stop(self, grace_s: float = 30.0) -> float:
        started = time.monotonic()
        if self.container is None:
            return 0.0
        import docker

        with contextlib.suppress(docker.errors.NotFound):
            self.container.stop(timeout=int(grace_s))
            self.log_path.write_bytes(self.container.logs())
            self.container.remove(force=True)
        self.container = None
        return time.monotonic() - started


def stray_containers() -> list[str]:
    """Running containers an experiment started (by label), when an engine is reachable."""
    try:
        import docker

        running = docker.from_env().containers.list(filters={"label": CONTAINER_LABEL})
    except Exception:  # no engine, no SDK configuration: no container of ours can be running
        return []
    return [f"{c.short_id} (image {c.attrs.get('Config', {}).get('Image', '?')}, serving {c.labels[CONTAINER_LABEL]})"
            for c in running]


def group_members(pgid: int) -> list[int]:
    """The group's processes still running (its zombies have ended)."""
    return [int(entry.name) for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and _running(int(entry.name)) == pgid]


def _group_alive(pgid: int) -> bool:
    return bool(group_members(pgid))


def client_cores(server_pgid: int) -> set[int] | None:
    """The cores no process of the server is bound to, when some are (a CPU server binds its compute worker to
    cores; a client sharing one with it is starved and reads whole streams in one burst at the end, which turns
    TTFT into end-to-end time). None when nothing is bound or no core is left over."""
    available = os.sched_getaffinity(0)
    bound: set[int] = set()
    for pid in group_members(server_pgid):
        with contextlib.suppress(OSError):
            cores = os.sched_getaffinity(pid)
            if cores < available:
                bound |= cores
    left = available - bound
    return left if bound and left else None
