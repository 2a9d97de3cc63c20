"""Which workload profile applies to a request, from the profiles the router holds.

Precedence (INTERFACES.md): `x-workload` header > the API key's profile > the model's
profile > `default`. The first source that names a profile decides; a name that is not
a known profile means `default` (never an error, never a fall-through to the next source).
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config import WorkloadProfile

VALID_MODES = ("auto", "threshold", "disagg", "local")


@dataclass(frozen=True)
class Profiles:
    """A versioned snapshot of every profile: swapped whole on update, never changed in
    place, so a request and its routing policy read one consistent profile."""

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
        """The named profile (a name from `resolve`), else `default`."""
        return self.by_name.get(name) or self.by_name.get("default") or WorkloadProfile()

    def as_dict(self) -> dict[str, dict]:
        return {name: p.model_dump() for name, p in sorted(self.by_name.items())}


def client_mode(profile: WorkloadProfile, header: str | None) -> str | None:
    """The `x-pd-mode` to honour: only a valid one, only where the profile allows it."""
    if not header or not profile.allow_client_override:
        return None
    mode = header.strip().lower()
    return mode if mode in VALID_MODES else None
