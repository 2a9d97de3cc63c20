"""The serving path's queue: an idle path changes nothing, a busy one delays and merges
tokens into chunks, and its two costs are recovered from runs that were made with them."""

from __future__ import annotations

from cluster.loadtest.client import RequestRecord
from cluster.plan.replay import read_run, replay
from cluster.plan.sim.frontend import Frontend, apply, token_times
from tests.test_plan_search import CALIBRATION
from tests.test_plan_validate import _simulated_run


def _record(i: int, sent: float, ttft: float, gaps: list[float]) -> RequestRecord:
    return RequestRecord(i, f"r{i}", "w", sent, sent_at_s=sent, ended_at_s=sent + ttft + sum(gaps), ttft_s=ttft,
                         e2e_s=ttft + sum(gaps), itl_s=gaps, num_chunks=len(gaps) + 1, completion_tokens=len(gaps) + 1,
                         status=200)


def test_an_idle_path_changes_nothing():
    records = [_record(0, 0.0, 0.05, [0.01] * 5), _record(1, 1.0, 0.05, [0.01] * 5)]
    assert apply(records, Frontend()) == records
    out = apply(records, Frontend(request_s=0.004, chunk_s=0.002))  # each job done before the next is ready
    for before, after in zip(records, out, strict=True):
        assert after.ttft_s == before.ttft_s and after.itl_s == before.itl_s


def test_a_busy_path_delays_first_tokens_and_merges_the_rest_into_chunks():
    # four streams emitting a token every 1 ms through a path that takes 2 ms a chunk
    records = [_record(i, 0.0, 0.01, [0.001] * 19) for i in range(4)]
    out = apply(records, Frontend(request_s=0.003, chunk_s=0.002))
    # arrivals take the path 0-3, 3-6, 6-9, 9-12 ms; the first tokens (ready at 10 ms)
    # leave at 12, 14, 16, 18 ms; each also later by its own arrival's wait: 0, 3, 6, 9
    assert [round(r.ttft_s, 6) for r in out] == [0.012, 0.017, 0.022, 0.027]
    for before, after in zip(records, out, strict=True):
        assert after.num_chunks < 20 and min(after.itl_s) > max(before.itl_s)  # fewer chunks, further apart
        times = token_times(after)
        assert (times[1:] > times[:-1]).all() and after.e2e_s >= before.e2e_s


def test_the_fit_recovers_the_costs_a_run_was_made_with(tmp_path):
    from cluster.loadtest.report import write_report
    from cluster.plan.frontend_fit import fit_frontend

    truth = Frontend(request_s=0.032, chunk_s=0.001)
    runs = []
    for rate in (2.0, 4.0):  # busy enough that arrivals queue on the path, not past the engines
        folder = tmp_path / f"r{rate:g}"
        _simulated_run(folder, rate=rate, seed=7)
        run = read_run(folder)  # rewrite its requests as the busy path would have delivered them
        records = apply(run.records, truth)
        from cluster.loadtest.metrics import summarize

        write_report(folder, summarize(records, run.slo, rate, run.summary.env), records, plots=False)
        runs.append(read_run(folder))
    found, loss = fit_frontend([(run, replay(run, CALIBRATION).records) for run in runs])
    # the arrivals' cost shows in TTFT; a chunk's much less where engine steps (~20 ms
    # here) space the tokens further apart than it takes: only the first is pinned
    assert found.request_s == truth.request_s and loss < 1e-3
