"""The experiment's journal: every profile change, appended (and flushed) before and after
it is made, so a process killed at any point leaves enough to restore the deployment
(`pdcluster experiment --rollback DIR`). It doubles as the report's audit trail."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

JOURNAL_FILE = "journal.jsonl"


class Journal:
    def __init__(self, out_dir: Path) -> None:
        self.path = Path(out_dir) / JOURNAL_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        row = {"t": time.time(), "event": event, **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return row

    def read(self) -> list[dict[str, Any]]:
        return read_journal(self.path.parent)


def read_journal(out_dir: Path) -> list[dict[str, Any]]:
    path = Path(out_dir) / JOURNAL_FILE
    if not path.exists():
        raise ValueError(f"{out_dir}: no {JOURNAL_FILE} (not an experiment's output folder)")
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a kill
    return rows
