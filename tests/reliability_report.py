"""The precise reliability figures for docs/reliability.md, from real runs.

    .venv/bin/python -m tests.reliability_report [--repeats 10] [--soak-seconds 300] [--fuzz 1000]

Runs the fault-injection suite (tests/test_reliability_cluster.py) once with each
scenario repeated `--repeats` times and tight tolerances off, collects what every
scenario measured (PDC_RELIABILITY_OUT), and prints a markdown table: per figure the
number of runs, min / median / max. Exit status is pytest's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--soak-seconds", type=float, default=60)
    parser.add_argument("--fuzz", type=int, default=1000)
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp()) / "figures.json"
    env = {**os.environ, "PDC_RELIABILITY_OUT": str(out), "PDC_RELIABILITY_REPEATS": str(args.repeats),
           "PDC_SOAK_SECONDS": str(args.soak_seconds), "PDC_FUZZ_EXAMPLES": str(args.fuzz),
           "RAY_ADDRESS": os.environ.get("RAY_ADDRESS", "local")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-W", "ignore::DeprecationWarning",
           "tests/test_reliability_cluster.py"]
    result = subprocess.run(cmd, env=env)
    figures = json.loads(out.read_text()) if out.exists() else {}
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    print(table(figures))
    return result.returncode


def table(figures: dict) -> str:
    lines = ["| figure | runs | min | median | max |", "|---|---|---|---|---|"]
    for name, values in sorted(figures.items()):
        numbers = [v for v in values if isinstance(v, (int, float))]
        if numbers:
            lines.append(f"| {name} | {len(numbers)} | {min(numbers):.3f} | "
                         f"{statistics.median(numbers):.3f} | {max(numbers):.3f} |")
        else:
            for value in values:
                lines.append(f"| {name} | 1 | {json.dumps(value)} | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
