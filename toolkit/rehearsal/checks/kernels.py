"""kernels: the served server's prebuilt device kernels (kind kernels) were imported and called, each computed on
this CPU by its reference, counted per module; a module whose switch is on and whose call-site guard the rehearsed
model meets, but that never ran, fails it (its import failed, its switch was read otherwise, or a transform routed
the model past it)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from toolkit.bench import experiment
from toolkit.bench.metrics import RequestRecord
from toolkit.errors import ToolkitError
from toolkit.rehearsal.checks.base import RehearsalCheck
from toolkit.rehearsal.checks.short import short_request
from toolkit.rehearsal.model import Check
from toolkit.rehearsal.servers import Live
from toolkit.runtime import standins
from toolkit.transforms.kernels import KernelModule, served_dtype


def kernels_check(env: Mapping[str, str | None], modules: list[tuple[str, KernelModule]], record: Path,
                  config: dict[str, object], tp: int, dtype: str) -> Check:
    """Per module of `modules` ((dotted import name, KernelModule)): called how often, or why it could not be."""
    if not record.is_file():
        return Check("kernels", False, f"the served server wrote no stand-ins record ({record}): nothing was seen")
    data = standins.read_record(record)
    loaded = {m for process in [data, *data.get("processes", [])] for m in process.get("modules", [])}
    computed: dict[str, int] = data.get("computed", {})
    called, missed, unreachable, off = [], [], [], []
    for dotted, module in modules:
        count = sum(n for name, n in computed.items() if name.startswith(dotted + "."))
        short = dotted.rpartition(".")[2]
        try:
            on = module.on(env)
        except ToolkitError as exc:  # the adapter raised on it at import too: the server never served
            missed.append(f"{short} ({exc.message})")
            continue
        if not on:
            off.append(f"{short} ({module.switch} 0)")
            continue
        unmet = module.unmet(config, tp, dtype)
        steps = [c for c in module.step_conditions() if c.startswith("a context")]
        if count:
            called.append(f"{short} x{count}")
        elif unmet or steps:
            unreachable.append(f"{short} (its guard needs {', '.join(unmet + steps)})")
        else:
            imported = "imported" if dotted in loaded else "never imported"
            missed.append(f"{short} ({module.switch} on, its guard met by the rehearsed model, {imported}, never "
                          "called)")
    parts = [f"called: {', '.join(called) or 'none'}"]
    if unreachable:
        parts.append(f"not reachable by the rehearsed model ({dtype}, TP {tp}; the census at the served widths "
                     f"counts them): {', '.join(unreachable)}")
    if off:
        parts.append(f"switched off: {', '.join(off)}")
    if missed:
        return Check("kernels", False, f"switched on and never ran: {'; '.join(missed)}; " + "; ".join(parts))
    return Check("kernels", True, "; ".join(parts))


class Kernels(RehearsalCheck):
    name = "kernels"
    summary = "each prebuilt kernel switched on ran (counted per module)"
    servers = ("served",)

    request: RequestRecord | None = None
    cause = ""  # the server's own error, where the request's failure does not carry it

    def not_applicable(self) -> str | None:
        return None if self.run.stage.recipe.kernels() else "the recipe installs no prebuilt kernels for its target"

    def on(self, server: str, live: Live) -> None:
        self.request = short_request(self.run, live)  # a prefill and decode steps, where the one-token kernels run
        if not self.request.ok and "the server's log" not in self.request.message:
            # a stream cut off mid-answer (the engine died after the 200): its cause is in the log, not the status
            self.cause = self.run.stage.server_error(live.server)

    def verdict(self) -> Check:
        if self.request is None:
            return self.unsent()
        check = self.counted()
        if not self.request.ok:  # a kernel that refused its arguments stops the engine, as on the card
            cause = f"; the server's log: {self.cause}" if self.cause else ""
            return Check("kernels", False, f"the short request failed: {self.request.message}{cause}; {check.detail}")
        return check

    def counted(self) -> Check:
        stage = self.run.stage
        config = json.loads((stage.model / "config.json").read_text(encoding="utf-8"))
        text = config.get("text_config", config)
        # vLLM 0.6.3 reads the text config's torch_dtype (a checkpoint without one is taken as float32)
        checkpoint = text.get("torch_dtype") or config.get("torch_dtype") or "float32"
        dtype = served_dtype(experiment.flag_value(self.run.served, "--dtype"), str(checkpoint))
        modules = [(f"{t.package_name}.{m.name}", m) for t in stage.recipe.kernels() for m in t.modules]
        return kernels_check(stage.recipe.env, modules, stage.rundir / "served-standins" / "standins.json", text,
                             stage.tp, dtype)
