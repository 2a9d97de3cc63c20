"""Changing a profile for a run and putting it back, safely.

The original of each profile is what the snapshot at the start recorded (None: the name
did not exist, so restoring deletes it). A profile is put back only while it still holds
what the experiment set; if it holds anything else, an operator changed it in between and
it is left as they set it (and the journal says so). Every write carries `If-Match`, so a
change that lands between the read and the write is never overwritten.
"""

from __future__ import annotations

from typing import Any

from cluster.experiment.admin import AdminClient, Conflict, normalized
from cluster.experiment.journal import Journal

RETRIES = 3


class Profiles:
    """The experiment's side of the admin API: apply, restore, and remember what it set."""

    def __init__(self, admin: AdminClient, journal: Journal) -> None:
        self.admin, self.journal = admin, journal
        version, workloads = admin.get()
        self.originals: dict[str, dict[str, Any] | None] = {}
        self.snapshot = workloads
        self.ours: dict[str, list[dict[str, Any]]] = {}
        journal.write("snapshot", version=version, workloads=workloads)

    def current(self, name: str) -> dict[str, Any] | None:
        return self.snapshot.get(name)

    def apply(self, name: str, profile: dict[str, Any]) -> int:
        """Set `name` to `profile` (from a state the experiment knows); the new version."""
        self.originals.setdefault(name, self.snapshot.get(name))
        wanted = normalized(profile)
        self.ours.setdefault(name, []).append(wanted)
        for _ in range(RETRIES):
            version, workloads = self.admin.get()
            current = workloads.get(name)
            if current == wanted:
                return version
            if current != self.originals[name] and current not in self.ours[name]:
                raise Conflict(f"workload {name!r} was changed by someone else during the experiment "
                               f"(now {current}); stopping so their change stands")
            self.journal.write("apply", workload=name, profile=wanted, if_match=version)
            try:
                new_version, stored = self.admin.put(name, wanted, if_match=version)
            except Conflict:
                continue
            self.journal.write("applied", workload=name, profile=stored, version=new_version)
            return new_version
        raise Conflict(f"workload {name!r}: the profiles kept changing; could not apply the variant")

    def restore_all(self) -> list[dict[str, Any]]:
        return [restore(self.admin, self.journal, name, original, self.ours.get(name, []))
                for name, original in self.originals.items()]


def restore(admin: AdminClient, journal: Journal, name: str, original: dict[str, Any] | None,
            ours: list[dict[str, Any]]) -> dict[str, Any]:
    """Put `name` back to `original` if it still holds one of `ours`; the journal row."""
    for _ in range(RETRIES):
        version, workloads = admin.get()
        current = workloads.get(name)
        if current == original:
            return journal.write("restored", workload=name, action="unchanged", version=version)
        if current not in ours:
            return journal.write("left", workload=name, version=version, current=current,
                                 reason="changed by someone else since the experiment set it: left as they set it")
        journal.write("restore", workload=name, to=original, if_match=version)
        try:
            if original is None:
                new_version = admin.delete(name, if_match=version)
            else:
                new_version = admin.put(name, original, if_match=version)[0]
        except Conflict:
            continue
        return journal.write("restored", workload=name, action="delete" if original is None else "put",
                             version=new_version)
    return journal.write("left", workload=name, reason="the profiles kept changing; restore it by hand")


def rollback_dir(admin: AdminClient, journal: Journal) -> list[dict[str, Any]]:
    """Restore every profile an earlier (perhaps killed) experiment changed, from its journal."""
    rows = journal.read()
    snapshot = next((r for r in rows if r["event"] == "snapshot"), None)
    if snapshot is None:
        raise ValueError(f"{journal.path}: no snapshot: the experiment changed nothing")
    ours: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["event"] in ("apply", "applied"):
            ours.setdefault(row["workload"], []).append(normalized(row["profile"]))
    journal.write("rollback", workloads=sorted(ours))
    return [restore(admin, journal, name, snapshot["workloads"].get(name), applied)
            for name, applied in ours.items()]
