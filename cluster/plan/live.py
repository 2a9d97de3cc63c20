"""A deployment's step and transfer records over its admin API (`GET /admin/steps`,
`Authorization: Bearer $PDC_ADMIN_TOKEN`), once or for the length of a run.

A replica keeps its newest 4096 step records (`LLMEngine(max_step_records=...)`) and
4096 transfer records: about 10-40 s of steps on a CPU, far less on a GPU, so a run's
records cannot be fetched once at its end. `StepsCollector` polls every `POLL_S`
seconds while the run goes on (each poll asks for what ended since the last one, less
a margin, and keeps each record once) and once more at the end: the records span the
whole run however long it is, with no replica setting to change. A replica whose ring
went round between two polls (its oldest record in a poll is newer than the last one
kept, and the poll came back full) is counted in `num_gaps`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from cluster.plan.records import RecordSet, from_admin_answer, write_run_records

TOKEN_ENV = "PDC_ADMIN_TOKEN"
POLL_S = 2.0
POLL_MARGIN_S = 1.0  # asked again: a record that ended just before the last poll was answered
POLL_LIMIT = 4096  # a replica's whole ring


class AdminError(RuntimeError):
    """The admin API could not be used; the message says what to do."""


def admin_token(token: str | None = None) -> str:
    token = token or os.environ.get(TOKEN_ENV)
    if not token:
        raise AdminError(f"no admin token: set {TOKEN_ENV} to the deployment's admin token")
    return token


def fetch_steps(url: str, token: str, since: float = 0.0, limit: int = POLL_LIMIT, timeout_s: float = 30.0) -> dict:
    """One `GET /admin/steps` answer; AdminError with what to do on any failure."""
    url = url.rstrip("/")
    try:
        resp = httpx.get(f"{url}/admin/steps", params={"since": repr(since), "limit": str(limit)},
                         headers={"authorization": f"Bearer {token}"}, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise AdminError(f"{url} is unreachable ({type(e).__name__}: {e}); check the URL and that "
                         f"`pdcluster serve` is running") from None
    if resp.status_code == 401:
        raise AdminError(f"{url}: the admin token was refused (401); set {TOKEN_ENV} to the token the "
                         f"deployment was started with")
    if resp.status_code == 403:
        raise AdminError(f"{url}: the admin API is off (403); start the deployment with an admin token "
                         f"(secrets.admin_token_file or {TOKEN_ENV})")
    if resp.status_code != 200:
        raise AdminError(f"{url}/admin/steps: HTTP {resp.status_code} {resp.text[:200]}")
    return resp.json()


def fetch_profiles(url: str, token: str, timeout_s: float = 30.0) -> dict:
    """The workload profiles the router routes by (`GET /admin/workloads`): {name: profile}."""
    url = url.rstrip("/")
    try:
        resp = httpx.get(f"{url}/admin/workloads", headers={"authorization": f"Bearer {token}"}, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise AdminError(f"{url} is unreachable ({type(e).__name__}: {e})") from None
    if resp.status_code != 200:
        raise AdminError(f"{url}/admin/workloads: HTTP {resp.status_code} {resp.text[:200]}")
    return resp.json().get("workloads", {})


def fetch_records(url: str, token: str | None = None, since: float = 0.0) -> RecordSet:
    """Every replica's records now (the newest `POLL_LIMIT` of each kind, each replica)."""
    return from_admin_answer(fetch_steps(url, admin_token(token), since))


class StepsCollector:
    """Polls `GET /admin/steps` in a thread from `start()` to `stop()`; `records` holds
    each record once. A failed poll is retried at the next one; the last error is kept."""

    def __init__(self, url: str, token: str, poll_s: float = POLL_S) -> None:
        self.url, self._token, self.poll_s = url, token, poll_s
        self.records = RecordSet()
        self.num_gaps = 0
        self.num_polls = 0
        self.last_error: str | None = None
        self._seen: set[tuple] = set()
        self._newest: dict[str, float] = {}  # replica -> start_time of its newest step kept
        self._since = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> StepsCollector:
        self._since = time.time()
        fetch_steps(self.url, self._token, self._since, limit=0)  # fail now on a bad URL or token
        self._thread = threading.Thread(target=self._loop, name="steps-collector", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> RecordSet:
        """Stop polling, poll once more, and return everything kept."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.poll()
        return self.records

    def __enter__(self) -> StepsCollector:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except AdminError as e:
                self.last_error = str(e)

    def poll(self) -> None:
        asked_at = time.time()
        new = from_admin_answer(fetch_steps(self.url, self._token, self._since))
        self._since = max(self._since, asked_at - POLL_MARGIN_S)
        self.num_polls += 1
        self._count_gaps(new)
        self.records.steps += [s for s in new.steps if self._first_time(("s", s.replica_id, s.record))]
        self.records.transfers += [t for t in new.transfers if self._first_time(("t", t.replica_id, t.record))]
        self.records.extend(RecordSet(deployment=new.deployment))

    def _first_time(self, key: tuple) -> bool:
        key = (key[0], key[1], *dataclasses.astuple(key[2]))
        if key in self._seen:
            return False
        self._seen.add(key)
        return True

    def _count_gaps(self, new: RecordSet) -> None:
        by_replica: dict[str, list[float]] = {}
        for s in new.steps:
            by_replica.setdefault(s.replica_id, []).append(s.record.start_time)
        for replica_id, starts in by_replica.items():
            newest = self._newest.get(replica_id)
            if newest is not None and len(starts) >= POLL_LIMIT and min(starts) > newest:
                self.num_gaps += 1
            self._newest[replica_id] = max(starts)


@contextlib.contextmanager
def saving_steps(url: str, out_dir: str | Path, token: str | None = None) -> Iterator[StepsCollector]:
    """Collect the deployment's records for the duration of the block, then write
    steps.jsonl, transfers.jsonl and deployment.json (with how the collection went, and
    the workload profiles the router routed by at the start) into `out_dir`. Fails
    before the block on a bad URL or token."""
    token = admin_token(token)
    profiles = fetch_profiles(url, token)
    collector = StepsCollector(url, token).start()
    try:
        yield collector
    finally:
        records = collector.stop()
        records.deployment["workloads"] = profiles
        records.deployment["collection"] = {"poll_s": collector.poll_s, "num_polls": collector.num_polls,
                                            "num_gaps": collector.num_gaps, "last_error": collector.last_error}
        write_run_records(out_dir, records)
