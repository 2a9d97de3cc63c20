"""Waiting for a freshly deployed Serve app to answer."""

from __future__ import annotations

import time

import httpx


def wait_ok(base: str, timeout_s: float = 120.0) -> None:
    """Until `base/health` says `ok`; an AssertionError with the last answer after `timeout_s`."""
    deadline, last = time.monotonic() + timeout_s, "no answer"
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{base}/health", timeout=5)
            if response.json().get("status") == "ok":
                return
            last = response.text
        except (httpx.HTTPError, ValueError) as e:
            last = repr(e)
        time.sleep(0.3)
    raise AssertionError(f"{base}/health never said ok in {timeout_s:g} s: {last}")
