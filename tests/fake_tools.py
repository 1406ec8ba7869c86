"""Fake device tools for the monitor's tests: executables named like the vendor's, answering exactly the CSV query
the monitor sends (and nothing else), one per behaviour seen on real machines."""

from __future__ import annotations

import os
from pathlib import Path

QUERY = "--query-gpu=index,utilization.gpu,memory.used,memory.total,{power} --format=csv,noheader,nounits"

# nvidia-smi (and ixsmi on CoreX 3.x): power.draw; device 1 reports no power, as some cards do
NVIDIA = f"""#!/bin/sh
if [ "$*" = "{QUERY.format(power='power.draw')}" ]; then
  echo "0, 28, 30000, 32768, 49.70"
  echo "1, 31, 2000, 32768, [N/A]"
else
  echo "unexpected arguments: $*" >&2; exit 2
fi
"""

# the same two cards with nothing held (a leftover's memory refuses an experiment's start)
NVIDIA_IDLE = (NVIDIA.replace("0, 28, 30000, 32768", "0, 3, 100, 32768")
               .replace("1, 31, 2000, 32768", "1, 0, 200, 32768"))

# ixsmi on CoreX 4.x: the power field is gpu.power.draw, power.draw is refused
IXSMI_4 = f"""#!/bin/sh
if [ "$*" = "{QUERY.format(power='gpu.power.draw')}" ]; then
  echo "0, 29, 1024, 32768, 50.10"
elif [ "$*" = "{QUERY.format(power='power.draw')}" ]; then
  echo 'Field "power.draw" is not a valid field to query.' >&2; exit 2
else
  echo "unexpected arguments: $*" >&2; exit 2
fi
"""

HANGING = """#!/bin/sh
sleep 60
"""

GARBAGE = """#!/bin/sh
echo "ixsmi: the driver is not loaded, try again"
"""


def install(folder: Path, name: str, script: str) -> Path:
    """The tool as `name` in `folder` (put it first on PATH); returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(script)
    path.chmod(0o755)
    return folder


def path_with(folder: Path) -> str:
    return f"{folder}:{os.environ['PATH']}"
