"""A prefill replica's KV transfer cost per decode peer: every `TransferRecord` names the
receiver address its layers went to, and `TransferTails` fits fixed + bytes / bandwidth
on the records' exposed tails, per peer and pooled, learning each record once."""

from __future__ import annotations

import json
import random
import time
from collections import deque

import pytest

from tests.test_transport_backends import KEY
from transport.transfer_record import TransferRecord
from workers.engine import SamplingParams
from workers.engine.transfer_cost import (
    DEFAULT_TRANSFER,
    TransferCoefficients,
    TransferTails,
    records_after,
)
from workers.engine_worker import _recent
from workers.protocol import StepsReply
from workers.stream.wire import CHUNK, StreamCodec, steps_reply_from_wire, to_wire

PROMPT = [(5 * i + 1) % 250 for i in range(40)]
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
FAST, SLOW = "tcp://10.0.0.1:5000?paths=inline", "tcp://10.0.0.2:5000?paths=inline"


def test_the_peer_travels_to_admin_steps():
    """What `GET /admin/steps` is built from: the worker's `_recent` maps, sealed in a
    stream CHUNK as the worker stream's server sends it, checked by the router's parser."""
    record = TransferRecord("t1", 4096, 4, "tcp", 101.5, 0.02, 0.005, FAST)
    codec = StreamCodec(KEY)
    chunk = {"t": CHUNK, "id": 1, "i": 0, "c": to_wire(StepsReply("prefill", [], _recent([record], 0.0, 10)))}
    reply = steps_reply_from_wire(codec.open(codec.seal(chunk))["c"])
    assert [TransferRecord(**r) for r in reply.transfers] == [record]


def synthetic_records(peer: str, fixed_s: float, bytes_per_s: float, n: int, seed: int,
                      noise: float = 0.02) -> list[TransferRecord]:
    rng = random.Random(seed)
    records = []
    for i in range(n):
        num_bytes = rng.randint(1 << 14, 1 << 26)
        tail = (fixed_s + num_bytes / bytes_per_s) * rng.uniform(1 - noise, 1 + noise)
        # `seconds` (the whole transfer) is larger; the model must fit the tail only
        records.append(TransferRecord(f"{peer}-{i}", num_bytes, 4, "tcp", time.time() - 10 + 0.01 * i, tail + 0.5, tail, peer))
    return records


def test_tails_recover_each_peers_fixed_cost_and_bandwidth():
    tails = TransferTails("p0")
    sent: deque[TransferRecord] = deque(maxlen=4096)  # as a sender keeps them
    assert tails.to_dict() == {"*": DEFAULT_TRANSFER.to_dict()}
    fast = synthetic_records(FAST, 0.001, 1e10, 120, seed=1)
    slow = synthetic_records(SLOW, 0.020, 5e8, 120, seed=2)
    for i in range(0, 120, 30):  # records arrive between reports, interleaved across peers
        sent.extend(fast[i:i + 30] + slow[i:i + 30])
        assert tails.learn(sent) == 60
        assert tails.learn(sent) == 0  # nothing learned twice
    model = json.loads(json.dumps(tails.to_dict()))  # what the heartbeat carries
    assert set(model) == {FAST, SLOW, "*"}
    got = {peer: TransferCoefficients.from_dict(c) for peer, c in model.items()}
    assert got[FAST].fixed_s == pytest.approx(0.001, rel=0.1) and got[FAST].bytes_per_s == pytest.approx(1e10, rel=0.05)
    assert got[SLOW].fixed_s == pytest.approx(0.020, rel=0.1) and got[SLOW].bytes_per_s == pytest.approx(5e8, rel=0.05)
    assert got[FAST].num_samples == got[SLOW].num_samples == 120 and got["*"].num_samples == 240
    size = 1 << 24
    assert tails.costs.predict("p0", FAST, size) < tails.costs.predict("p0", "never-seen", size) \
        < tails.costs.predict("p0", SLOW, size)


def test_records_after_the_last_one_learned():
    records = synthetic_records(FAST, 0.001, 1e9, 10, seed=3)
    sent: deque[TransferRecord] = deque(records[:4], maxlen=4)
    assert records_after(sent, None) == records[:4]
    assert records_after(sent, records[3]) == []
    sent.extend(records[4:6])  # records[0:2] evicted
    assert records_after(sent, records[3]) == records[4:6]
    sent.extend(records[6:10])  # the last one learned evicted too: every record held is new
    assert records_after(sent, records[5]) == records[6:10]


def test_tail_samples_age_out_to_the_default():
    """A link measured slow and not used since is predicted from the default again."""
    from workers.engine.transfer_cost import DEFAULT_TRANSFER, TransferCostFit

    fit = TransferCostFit(max_age_s=30.0)
    old = time.time() - 100.0
    for size in (1e5, 2e5, 4e5, 8e5):
        fit.observe(size, 0.5 + size / 1e6, at=old)
    assert fit.coefficients == DEFAULT_TRANSFER
    fit.observe(1e5, 0.6)
    assert fit.coefficients.num_samples == 1 and fit.predict(1e5) > DEFAULT_TRANSFER.fixed_s


def test_a_link_that_stalls_for_seconds_is_followed_after_two_transfers():
    """A miss by whole seconds is a remote request late by as much: two in a row restart
    the fit, where a moderate change (3x, milliseconds) still takes `CHANGE_RUN`. A
    young fit (four samples) follows too."""
    from workers.engine.transfer_cost import BIG_CHANGE_RUN, CHANGE_RUN, TransferCostFit

    for num_before in (4, 50):
        fit = TransferCostFit()
        for _ in range(num_before):
            fit.observe(1e6, 0.005)
        for _ in range(BIG_CHANGE_RUN - 1):
            fit.observe(1e6, 3.9)
        assert fit.predict(1e6) < 0.1
        fit.observe(1e6, 3.9)
        assert fit.predict(1e6) == pytest.approx(3.9, rel=0.01) and fit.coefficients.num_samples == BIG_CHANGE_RUN

    moderate = TransferCostFit()
    for _ in range(50):
        moderate.observe(1e6, 0.005)
    for _ in range(CHANGE_RUN - 1):
        moderate.observe(1e6, 0.015)
    assert moderate.predict(1e6) < 0.008
    moderate.observe(1e6, 0.015)
    assert moderate.predict(1e6) == pytest.approx(0.015, rel=0.01)

    blip = TransferCostFit()  # one stall between ordinary transfers restarts nothing
    for i in range(60):
        blip.observe(1e6, 3.9 if i % 10 == 9 else 0.005)
    assert blip.coefficients.num_samples == 60 and blip.predict(1e6) < 0.1


def test_the_pooled_fit_drops_a_changed_links_old_samples():
    """A decode peer never sent to is priced from the pooled fit, which holds the pairs'
    windows as they stand: after one pair's link restarts, its old samples are gone from
    the pool too, and every other pair's stay."""
    from workers.engine.transfer_cost import BIG_CHANGE_RUN, TransferCosts

    costs = TransferCosts()
    for _ in range(50):
        costs.observe("p0", FAST, 1e6, 0.005)
    for i in range(BIG_CHANGE_RUN):  # the replica's link slows to seconds
        costs.observe("p0", FAST, 1e6, 3.9)
        assert costs.predict("p0", "joined-since", 1e6) < 0.1 or i == BIG_CHANGE_RUN - 1
    assert costs.fit_for("p0", FAST).coefficients.num_samples == BIG_CHANGE_RUN
    assert costs.predict("p0", "joined-since", 1e6) == pytest.approx(3.9, rel=0.01)

    for _ in range(20):  # a second peer, fast: the pool is the two windows together
        costs.observe("p0", SLOW, 1e6, 0.005)
    assert costs.coefficients()["*"].num_samples == BIG_CHANGE_RUN + 20
    for _ in range(6):  # the first link recovers, and its fit restarts: its stalls leave the pool
        costs.observe("p0", FAST, 1e6, 0.004)
    recovered = costs.fit_for("p0", FAST).samples()
    assert max(seconds for *_, seconds in recovered) < 0.01
    pool = costs.fit_for("p0", "joined-since").samples()
    assert len(pool) == len(recovered) + 20 and max(seconds for *_, seconds in pool) < 0.01
    assert costs.predict("p0", "joined-since", 1e6) < 0.01


def test_a_changed_link_is_followed_within_a_few_transfers():
    """A link that slows down (or recovers) is refitted from its new samples after
    `CHANGE_RUN` misses in a row, not averaged against a window of the old link."""
    from workers.engine.transfer_cost import CHANGE_RUN, TransferCostFit

    fit = TransferCostFit()
    rng = random.Random(5)
    sizes = [rng.choice((1e5, 4e5, 1.6e6)) for _ in range(200)]
    for size in sizes[:100]:
        fit.observe(size, 0.004 + size / 1e9)
    assert fit.predict(4e5) == pytest.approx(0.0044, rel=0.05)
    for size in sizes[100:100 + CHANGE_RUN]:  # every transfer now waits 0.8 s more
        fit.observe(size, 0.804 + size / 1e9)
    assert fit.coefficients.num_samples == CHANGE_RUN and fit.predict(4e5) == pytest.approx(0.8044, rel=0.05)
    for size in sizes[100 + CHANGE_RUN:110]:
        fit.observe(size, 0.804 + size / 1e9)
    for size in sizes[110:110 + CHANGE_RUN]:  # and recovers
        fit.observe(size, 0.004 + size / 1e9)
    assert fit.predict(4e5) == pytest.approx(0.0044, rel=0.05)
    noisy = TransferCostFit()  # noise within 2x never restarts a fit
    for size in sizes:
        noisy.observe(size, (0.004 + size / 1e9) * rng.uniform(0.6, 1.6))
    assert noisy.coefficients.num_samples == len(sizes)
