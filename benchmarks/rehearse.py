"""How long one flagship rehearsal takes on this machine, against the least a rehearsal can be.

The baseline, measured in the same run: the served server started as the run config says and one short request
answered (`--check short`: what any by-hand CPU trial of a submission would have to do). Then the whole rehearsal
(every check: the 29-tool request, the multi-system conversation, the forced parser outputs, the profile, the
prefix-cache comparison on two more servers). Prints both, their ratio, and the issue's goal (under 3 minutes for
the whole rehearsal on 2 cores).

    python benchmarks/rehearse.py [--source qwen36-adapter=CLONE@COMMIT] [--tp 2]

Without --source the adapter's files at the flagship's pin (../shared/qwen36-adapter-5a1c8c7, checked against its
BLOBS.txt by tests/pinned_adapter.py) are committed into a temporary repository: the adapter is third-party code
this repository never holds. Exits 1 when a check fails (a rehearsal that fails is no time to report).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from adapter_source import pinned_source  # benchmarks/, the script's own folder

from toolkit.commands.common import Inputs
from toolkit.commands.rehearse import RehearseRequest, rehearse

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "bi100-qwen36.yaml"
GOAL_S = 180.0



def _timed(request: RehearseRequest) -> tuple[float, dict[str, object]]:
    start = time.perf_counter()
    report = rehearse(request)
    took = time.perf_counter() - start
    [variant] = report.as_json()["variants"]
    failed = [c["name"] for c in variant["checks"] if not c["ok"]]
    return took, {"checks": len(variant["checks"]), "failed": failed, "ready_s": variant["ready_s"],
                  "first_token_s": variant["first_token_s"], "servers": len(variant["logs"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", help="qwen36-adapter=CLONE@COMMIT (default: the pinned files in ../shared)")
    parser.add_argument("--tp", type=int, default=None, help="tensor parallel size (default: the rehearsal's, 2)")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-rehearse-") as tmp:
        work = Path(tmp)
        source = args.source.partition("=")[2] if args.source else pinned_source(work, "rehearse")
        inputs = Inputs(sources={"qwen36-adapter": source})
        print("rehearse benchmark: baseline (start + one short request)...", file=sys.stderr, flush=True)
        base_s, base = _timed(RehearseRequest(RECIPE, inputs, tp=args.tp, output=work / "baseline",
                                              checks=("short",)))
        print("rehearse benchmark: the whole rehearsal...", file=sys.stderr, flush=True)
        full_s, full = _timed(RehearseRequest(RECIPE, inputs, tp=args.tp, output=work / "full"))
    result = {"baseline_s": round(base_s, 1), "rehearsal_s": round(full_s, 1), "ratio": round(full_s / base_s, 2),
              "goal_s": GOAL_S, "goal_met": full_s < GOAL_S, "baseline": base, "rehearsal": full}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"baseline (start + short request): {base_s:6.1f} s  ({base['servers']} server, ready after "
              f"{base['ready_s']:.1f} s)")
        print(f"whole rehearsal ({full['checks']} checks):  {full_s:6.1f} s  ({full['servers']} servers)")
        print(f"ratio rehearsal / baseline:       {full_s / base_s:6.2f}")
        print(f"goal: under {GOAL_S:.0f} s: {'met' if full_s < GOAL_S else 'NOT met'}"
              + (f"; failed checks: {', '.join(full['failed'])}" if full["failed"] else ""))
    return 1 if full["failed"] or base["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
