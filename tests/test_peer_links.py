"""A prefill replica's transfer model as the router reads it: each peer's fit parsed when
a decision first prices that peer, an unreadable one taken as absent."""

from __future__ import annotations

import workers.engine.transfer_cost as transfer_cost
from router.peer_links import PeerLinks
from router.replica_load import from_stats
from workers.engine.transfer_cost import DEFAULT_TRANSFER, TransferCoefficients

SLOW = TransferCoefficients(0.05, 1e6, 8)
POOLED = TransferCoefficients(0.002, 1e9, 40)


def _model(**peers: TransferCoefficients) -> dict:
    return {peer: link.to_dict() for peer, link in peers.items()}


def test_a_peers_fit_is_parsed_when_first_priced_and_once(monkeypatch):
    parsed = []
    real = TransferCoefficients.from_dict.__func__
    monkeypatch.setattr(transfer_cost.TransferCoefficients, "from_dict",
                        classmethod(lambda cls, d: parsed.append(d) or real(cls, d)))
    load = from_stats("p1", "prefill", {"transfer_model": _model(**{"tcp://d1": SLOW, "tcp://d2": SLOW, "*": POOLED})})
    assert parsed == []  # taking in the heartbeat parsed no fit
    assert load.tail_to("tcp://d1", 1e6) == SLOW.fixed_s + 1.0 and len(parsed) == 1
    load.tail_to("tcp://d1", 2e6)
    assert len(parsed) == 1  # kept


def test_an_unknown_or_unreadable_peer_is_priced_by_the_pooled_fit():
    model = {**_model(**{"*": POOLED}), "tcp://d1": {"fixed_s": 0.1}, "tcp://d2": "fast"}
    load = from_stats("p1", "prefill", {"transfer_model": model})
    for peer in ("tcp://d1", "tcp://d2", "tcp://d3"):
        assert load.transfer_to(peer) == POOLED
    assert from_stats("p1", "prefill", {"transfer_model": "garbled"}).transfer_to("tcp://d1") == DEFAULT_TRANSFER


def test_it_reads_as_the_dict_of_its_readable_fits():
    links = PeerLinks({**_model(d1=SLOW, d2=POOLED), "d3": None})
    assert links == {"d1": SLOW, "d2": POOLED} and len(links) == 2 and sorted(links) == ["d1", "d2"]
    assert links["d1"] == SLOW and "d3" not in links and links.get("d3", POOLED) == POOLED
