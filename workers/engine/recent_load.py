"""What the streams on this replica saw lately in steps that only decode: the mean gap
between their tokens and the decode batch they shared, over the last `WINDOW_S` of step
records.

A request's TPOT is its mean gap over tens of steps, during which streams come and go
and prompts arriving after it prefill beside it. The replica's state at the moment a
request is routed says little about that (on a CPU bench, a constant at the run's median
TPOT predicted each request's TPOT better than the state did); the recent past of the
same replica says more, and still follows a change of load within the window.

The gap is measured start to start between consecutive steps that decode, so the time
between steps (scheduling, streaming tokens out) counts as the streams see it. Left out:
a pause longer than `MAX_GAP_S` (an engine that stopped); the gap after a stream's last
token, which no stream waits through (after a replica's last stream ends it is the engine
idling until the next request: a replica decoding one 16-token request every 0.7 s read
a 55 ms gap while its streams measured 20 ms); and steps that also computed prompt
tokens: the predictions price a prefill beside streams from the queue they see, and a
one-off long prefill of the last 10 s counted here as well made every later stream's gap
look several times longer than it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from workers.engine.step_cost import StepRecord

WINDOW_S = 10.0
MAX_GAP_S = 2.0
MIN_STEPS = 8  # fewer decoding steps in the window: nothing to report


@dataclass(frozen=True)
class RecentLoad:
    stream_gap_s: float  # the mean gap a decoding stream saw, weighted by streams per step
    decode_seqs: float  # the mean batch of streams going on, weighted by time
    num_steps: int

    def to_stats(self) -> dict[str, float | int]:
        return {"recent_stream_gap_s": self.stream_gap_s, "recent_decode_seqs": self.decode_seqs,
                "recent_decode_steps": self.num_steps}


def recent_load(records: Sequence[StepRecord], now: float, window_s: float = WINDOW_S) -> RecentLoad | None:
    """Over the records of the last `window_s` (oldest first in `records`), or None with
    fewer than `MIN_STEPS` decoding steps."""
    seq_gap = seqs = time_total = 0.0  # seq_gap: the gaps x streams, both means' numerator
    steps = 0
    later: StepRecord | None = None
    for record in reversed(records):
        if record.start_time < now - window_s:
            break
        streams = record.num_decode_seqs - record.num_finished_streams  # those that wait for `later`
        if later is not None and streams > 0 and record.num_prefill_tokens == 0:
            gap = later.start_time - record.start_time
            if 0.0 < gap <= MAX_GAP_S:
                seq_gap += gap * streams
                seqs += streams
                time_total += gap
                steps += 1
        later = record
    if steps < MIN_STEPS or seqs == 0:
        return None
    return RecentLoad(seq_gap / seqs, seq_gap / time_total, steps)
