"""Workload profiles as the router holds them, and which one applies to a request.

Precedence (INTERFACES.md): `x-workload` header > the API key's profile > the model's
profile > `default`. The first source that names a profile decides; a name that is not
a known profile means `default` (never an error, never a fall-through to the next source).
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config import WorkloadProfile
from router.policy import ProfileView

VALID_MODES = ("auto", "disagg", "local")


@dataclass(frozen=True)
class Profiles:
    """A versioned, immutable snapshot of every profile (swapped whole on update)."""

    version: int
    by_name: dict[str, WorkloadProfile]

    def resolve(self, header: str | None, key_profile: str | None = None,
                model_profile: str | None = None) -> str:
        """The name of the profile that applies."""
        for source in (header, key_profile, model_profile):
            if source:
                return source if source in self.by_name else "default"
        return "default"

    def get(self, name: str) -> WorkloadProfile:
        return self.by_name.get(name) or self.by_name.get("default") or WorkloadProfile()

    def as_dict(self) -> dict[str, dict]:
        return {name: p.model_dump() for name, p in sorted(self.by_name.items())}


def view(profile: WorkloadProfile) -> ProfileView:
    return ProfileView(mode=profile.mode, min_remote_prefill_tokens=profile.min_remote_prefill_tokens,
                       max_prefill_queue=profile.max_prefill_queue,
                       max_local_prefill_tokens_while_decoding=profile.max_local_prefill_tokens_while_decoding)


def client_mode(profile: WorkloadProfile, header: str | None) -> str | None:
    """The `x-pd-mode` to honour: only a valid one, only where the profile allows it."""
    if not header or not profile.allow_client_override:
        return None
    mode = header.strip().lower()
    return mode if mode in VALID_MODES else None
