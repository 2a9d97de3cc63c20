"""The admin API as the experiment uses it: read every profile, and change or delete one
only if nothing changed since it was read (`If-Match: VERSION`, 409 otherwise)."""

from __future__ import annotations

from typing import Any

import httpx

from cluster.config import WorkloadProfile


class AdminError(RuntimeError):
    """The admin API refused or could not be reached; the message says what to do."""


class Conflict(AdminError):
    """Another change came in between (HTTP 409)."""


def normalized(profile: dict[str, Any]) -> dict[str, Any]:
    """A profile as the server stores and shows it (every field, defaults filled in)."""
    return WorkloadProfile.model_validate(profile).model_dump(mode="json")


class AdminClient:
    def __init__(self, url: str, token: str | None, timeout_s: float = 10.0) -> None:
        if not token:
            raise AdminError("PDC_ADMIN_TOKEN is not set: the experiment changes profiles through the admin API")
        self.url = url.rstrip("/")
        self.http = httpx.Client(timeout=timeout_s, headers={"authorization": f"Bearer {token}"})

    def close(self) -> None:
        self.http.close()

    def get(self) -> tuple[int, dict[str, dict[str, Any]]]:
        body = self._send("GET", "/admin/workloads")
        return int(body["version"]), dict(body["workloads"])

    def put(self, name: str, profile: dict[str, Any], if_match: int) -> tuple[int, dict[str, Any]]:
        body = self._send("PUT", f"/admin/workloads/{name}", json=profile, if_match=if_match)
        return int(body["version"]), dict(body["profile"])

    def delete(self, name: str, if_match: int) -> int:
        return int(self._send("DELETE", f"/admin/workloads/{name}", if_match=if_match)["version"])

    def _send(self, method: str, path: str, json: Any = None, if_match: int | None = None) -> dict[str, Any]:
        headers = {} if if_match is None else {"if-match": str(if_match)}
        try:
            response = self.http.request(method, self.url + path, json=json, headers=headers)
        except httpx.HTTPError as e:
            raise AdminError(f"{method} {path}: cannot reach {self.url} ({e!r})") from None
        if response.status_code == 409:
            raise Conflict(f"{method} {path}: {_message(response)}")
        if response.status_code in (401, 403):
            raise AdminError(f"{method} {path}: HTTP {response.status_code}: {_message(response)} "
                             "(set PDC_ADMIN_TOKEN to the deployment's admin token)")
        if response.status_code != 200:
            raise AdminError(f"{method} {path}: HTTP {response.status_code}: {_message(response)}")
        return response.json()


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]
