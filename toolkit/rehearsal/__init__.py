"""`toolkit rehearse`: the server the platform starts, as its run config says, on the CPU runtime (the vendor's GPU
path on CPU tensors, the tiny model of the recipe's architecture), answering the official request shapes through
the toolkit's own bench client before any GPU sees the submission.

The run config's own argv and env run, with only the substitutions a CPU and a tiny model need, each one recorded
(what the run config says, what runs instead, why). Every check is a line of the report, ok, failed or not
applicable, with its reason.

- `model`: the sizes, a check's result, a substitution, the rehearsal's record.
- `servers`: the registry of servers (served, cache-on, cache-off, tp1), their argv and env, start and stop.
- `checks/`: one module a check and the one registry (`CHECKS`): when it applies, which servers it needs, what it
  sends and compares.
- `oracles`: the comparisons on token ids the `answers` check makes.
- `orchestrator`: starts each needed server once and hands it to every check that needs it.
- `locate`: where a failed start or request failed, in the patched tree.

It comes after the bench (its client, server and experiment helpers) and the runtime (the CPU runtime, the stand-ins,
the patched tree) and may import them and every earlier stage (lint's reading of the argv among them); only the
commands and the CLI import it. Inside it, a check imports the model, servers, requests and oracles, never the
package itself or the orchestrator.
"""

from __future__ import annotations

from toolkit.rehearsal.checks import CHECKS, REQUEST_CHECKS, refuse_unknown_checks
from toolkit.rehearsal.model import DEVICE_MEMORY_GB, Check, Rehearsal, Substitution
from toolkit.rehearsal.orchestrator import rehearse

__all__ = ["CHECKS", "DEVICE_MEMORY_GB", "REQUEST_CHECKS", "Check", "Rehearsal", "Substitution",
           "refuse_unknown_checks", "rehearse"]
