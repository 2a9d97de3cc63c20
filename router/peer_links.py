"""A prefill replica's reported transfer model, one fit per decode peer, each read when a
decision first prices a transfer to that peer.

A heartbeat carries a fit per decode replica the prefill replica has sent to (plus `*`,
pooled), and the router takes in every heartbeat at each poll; a request prices one peer
of each candidate. Parsing every fit at the poll was more than half of taking in 64
replicas' heartbeats (1,056 fits, 1.4 of 2.2 ms). A fit that cannot be read is taken as
absent, so the pooled fit or the default prices that peer.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from workers.engine.transfer_cost import TransferCoefficients

_UNREADABLE = object()


class PeerLinks(Mapping[str, TransferCoefficients]):
    """`{peer address: TransferCoefficients}` over a heartbeat's `transfer_model` (never
    changed in place: a heartbeat's stats are replaced), parsed per peer on first read."""

    __slots__ = ("_raw", "_parsed")

    def __init__(self, raw: Mapping[str, object] | None = None) -> None:
        self._raw: Mapping[str, object] = raw if isinstance(raw, Mapping) else {}
        self._parsed: dict[str, object] = {}

    def get(self, peer: str, default: TransferCoefficients | None = None) -> TransferCoefficients | None:
        link = self._parsed.get(peer)
        if link is None:
            link = self._parsed[peer] = _parse(self._raw.get(peer))
        return default if link is _UNREADABLE else link  # type: ignore[return-value]

    def __getitem__(self, peer: str) -> TransferCoefficients:
        link = self.get(peer)
        if link is None:
            raise KeyError(peer)
        return link

    def __iter__(self) -> Iterator[str]:
        return (peer for peer in self._raw if self.get(peer) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"PeerLinks({dict(self.items())!r})"


def _parse(fit: object) -> object:
    if not isinstance(fit, dict):
        return _UNREADABLE
    try:
        return TransferCoefficients.from_dict(fit)
    except (KeyError, TypeError, ValueError):
        return _UNREADABLE
