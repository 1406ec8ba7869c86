"""The hardware monitor: the vendor's device tool (nvidia-smi, or Iluvatar's ixsmi, which takes the same flags)
queried once a second while a run goes, per device utilisation, memory and power; and the device health check an
experiment makes before each start.

A tool that is missing, hangs or prints something other than the CSV it was asked for is a note, never a failed
run: the run is measured, only the devices are not. ixsmi names the power field `power.draw` on CoreX 3.x and
`gpu.power.draw` on 4.x; the first query tries one, then the other.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.pyenv import ISOLATE

CHOICES = ("auto", "nvidia-smi", "ixsmi", "none")
FIELDS = ("index", "utilization.gpu", "memory.used", "memory.total")
POWER_FIELDS = ("power.draw", "gpu.power.draw")
QUERY_TIMEOUT_S = 5.0
SAMPLES = "monitor.csv"
COLUMNS = ("t_s", "device", "utilization_pct", "memory_used_mib", "memory_total_mib", "power_w")


def _number(cell: str) -> float | None:
    cell = cell.strip()
    if cell.upper().strip("[]") in ("N/A", "NOT SUPPORTED", ""):
        return None
    return float(cell)  # ValueError: not the CSV asked for


def parse(text: str) -> list[tuple[int, float | None, float | None, float | None, float | None]]:
    """(device, util %, memory used MiB, memory total MiB, power W) per line; ValueError when a line is not that."""
    rows = []
    for line in text.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(FIELDS) + 1:
            raise ValueError(f"expected {len(FIELDS) + 1} comma-separated values, got {line[:120]!r}")
        index = int(cells[0])
        util, used, total, power = (_number(c) for c in cells[1:])
        rows.append((index, util, used, total, power))
    if not rows:
        raise ValueError("no device line")
    return rows


@dataclass
class Sample:
    t_s: float
    device: int
    utilization_pct: float | None
    memory_used_mib: float | None
    memory_total_mib: float | None
    power_w: float | None


@dataclass
class Monitor:
    """One device tool, resolved; `binary` None: not sampled, and `note` says why."""

    tool: str  # nvidia-smi or ixsmi (the name the user chose or auto found)
    binary: str | None
    note: str | None = None
    power_field: str = "power.draw"
    interval_s: float = 1.0
    samples: list[Sample] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _started: float = 0.0

    @classmethod
    def resolve(cls, choice: str, interval_s: float = 1.0) -> Monitor:
        """auto: ixsmi, else nvidia-smi, from PATH; a path or name of a compatible binary is taken as given."""
        if choice == "none":
            return cls("none", None, "devices not sampled: --monitor none")
        names = ("ixsmi", "nvidia-smi") if choice == "auto" else (choice,)
        for name in names:
            found = shutil.which(name)
            if found:
                monitor = cls(Path(name).name, found, interval_s=interval_s)
                monitor.find_power_field()
                return monitor
        return cls(names[-1] if choice != "auto" else "auto", None,
                   f"devices not sampled: no {' or '.join(names)} on PATH")

    @property
    def available(self) -> bool:
        return self.binary is not None

    def argv(self, power_field: str | None = None) -> list[str]:
        assert self.binary is not None
        query = ",".join((*FIELDS, power_field or self.power_field))
        return [self.binary, f"--query-gpu={query}", "--format=csv,noheader,nounits"]

    def query(self, power_field: str | None = None) -> list[tuple[int, float | None, float | None, float | None,
                                                                 float | None]]:
        """One reading of every device; RuntimeError saying what went wrong."""
        try:
            proc = subprocess.run(self.argv(power_field), capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{self.tool} did not answer within {QUERY_TIMEOUT_S:.0f} s") from None
        except OSError as exc:
            raise RuntimeError(f"{self.tool} could not run: {exc}") from None
        if proc.returncode != 0:
            raise RuntimeError(f"{self.tool} exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[:160]}")
        try:
            return parse(proc.stdout)
        except ValueError as exc:
            raise RuntimeError(f"{self.tool} printed something else than the CSV asked for ({exc})") from None

    def find_power_field(self) -> None:
        """Which power field this tool knows; off, with the reason, when it cannot answer at all."""
        errors = []
        for power in POWER_FIELDS:
            try:
                self.query(power)
            except RuntimeError as exc:
                errors.append(str(exc))
                if "did not answer" in str(exc):
                    break  # a hanging tool is not asked again
                continue
            self.power_field = power
            return
        self.note = f"devices not sampled: {errors[0]}" + (f"; with {POWER_FIELDS[1]}: {errors[1]}"
                                                             if len(errors) > 1 else "")
        self.binary = None

    def memory_used_mib(self) -> float | None:
        """All devices' memory in use now (None: not known)."""
        if not self.available:
            return None
        try:
            used = [row[2] for row in self.query() if row[2] is not None]
        except RuntimeError:
            return None
        return sum(used) if used else None

    def devices(self) -> list[int] | None:
        if not self.available:
            return None
        try:
            return [row[0] for row in self.query()]
        except RuntimeError:
            return None

    def start(self) -> None:
        self.samples, self.notes = [], []
        if not self.available:
            return
        self._stop.clear()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="toolkit-monitor", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        failures = 0
        while not self._stop.is_set():
            at = time.monotonic() - self._started
            try:
                rows = self.query()
            except RuntimeError as exc:
                failures += 1
                if failures == 1 or "did not answer" in str(exc):
                    self.notes.append(f"at {at:.0f} s: {exc}")
                if "did not answer" in str(exc):
                    self.notes.append("sampling stopped: a hanging tool would hold up the run's end")
                    return
            else:
                self.samples += [Sample(round(at, 3), *row) for row in rows]
            self._stop.wait(self.interval_s)

    def stop(self) -> list[Sample]:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(QUERY_TIMEOUT_S + 1)
            self._thread = None
        return list(self.samples)

    def summary(self) -> dict[str, Any]:
        """What summary.json keeps: per device mean and max of utilisation, memory used and power."""
        if not self.available:
            return {"tool": self.tool, "sampled": False, "note": self.note}
        devices: dict[str, dict[str, Any]] = {}
        for device in sorted({s.device for s in self.samples}):
            mine = [s for s in self.samples if s.device == device]
            entry: dict[str, Any] = {"samples": len(mine)}
            for name in ("utilization_pct", "memory_used_mib", "power_w"):
                values = [v for s in mine if (v := getattr(s, name)) is not None]
                entry[f"{name}_mean"] = round(sum(values) / len(values), 2) if values else None
                entry[f"{name}_max"] = max(values) if values else None
            totals = [s.memory_total_mib for s in mine if s.memory_total_mib is not None]
            entry["memory_total_mib"] = max(totals) if totals else None
            devices[str(device)] = entry
        out: dict[str, Any] = {"tool": self.tool, "sampled": True, "power_field": self.power_field,
                               "interval_s": self.interval_s, "devices": devices}
        if self.notes:
            out["notes"] = list(self.notes)
        if not self.samples:
            out["note"] = "no sample was taken (the run was shorter than the first reading, or every reading failed)"
        return out

    def write_samples(self, folder: Path) -> Path | None:
        if not self.samples:
            return None
        path = folder / SAMPLES
        with path.open("w", newline="", encoding="utf-8") as out:
            writer = csv.writer(out)
            writer.writerow(COLUMNS)
            for s in self.samples:
                writer.writerow([s.t_s, s.device, s.utilization_pct, s.memory_used_mib, s.memory_total_mib,
                                 s.power_w])
        return path


KERNEL_CHECK = ISOLATE + (
    "import sys, torch\n"
    "n = torch.cuda.device_count()\n"
    "for i in range(n):\n"
    "    x = torch.ones(64, device=f'cuda:{i}')\n"
    "    assert float((x * 2).sum().item()) == 128.0, i\n"
    "    print('ok', i, flush=True)\n"
    "print('devices', n, flush=True)\n"
)


# what runs the kernel check: (exit code, or None when it ran past the time limit; what it printed; its errors)
Check = Callable[[float], tuple[int | None, str, str]]


def local_check(python: Sequence[str], env: dict[str, str] | None = None) -> Check:
    """The kernel check run by a Python on this machine."""

    def run(timeout_s: float) -> tuple[int | None, str, str]:
        try:
            proc = subprocess.run([*python, "-c", KERNEL_CHECK], capture_output=True, text=True, timeout=timeout_s,
                                  env=env if env is not None else dict(os.environ))
        except subprocess.TimeoutExpired as exc:
            partial = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
            return None, partial, ""
        except OSError as exc:
            return 1, "", f"could not run {python[0]}: {exc}"
        return proc.returncode, proc.stdout, proc.stderr

    return run


def health(monitor: Monitor, check: Check, timeout_s: float = 60.0) -> tuple[bool, str]:
    """Every device the tool lists must answer it and run a tiny kernel from the serving Python within the time
    limit (cards that the tool lists while every kernel on them times out exist on this platform). (ok, what
    was found); no tool: ok, not checked."""
    listed = monitor.devices()
    if listed is None:
        return True, f"device health not checked: {monitor.note or 'the device tool did not answer'}"
    code, out, err = check(timeout_s)
    ran = [line.split()[1] for line in out.splitlines() if line.startswith("ok ")]
    if code is None:
        sick = [d for d in listed if str(d) not in ran]
        return False, (f"device {sick[0] if sick else '?'} did not run a 64-element kernel within {timeout_s:.0f} s "
                       f"({monitor.tool} lists devices {', '.join(map(str, listed))}; answered: "
                       f"{', '.join(ran) or 'none'})")
    if code != 0:
        tail = (err.strip().splitlines() or ["no output"])[-1][:200]
        return False, f"the kernel check failed after devices [{', '.join(ran)}]: {tail}"
    missing = [d for d in listed if str(d) not in ran]
    if missing:
        return False, (f"{monitor.tool} lists device(s) {', '.join(map(str, missing))} that the serving Python "
                       f"does not see (it ran on {', '.join(ran) or 'none'})")
    return True, f"{len(ran)} device(s) answered {monitor.tool} and ran a kernel"
