"""Prompt block hashes and per-run salts: what a run keeps of its prompts, and how a
repeated run gets fresh bytes with the same shape."""

from __future__ import annotations

from cluster.loadtest.config import LoadTestConfig
from cluster.loadtest.prompt_blocks import BLOCK_BYTES, prompt_block_hashes, run_salt, salted
from cluster.loadtest.runner import build_plan
from cluster.loadtest.workloads import take


def test_block_hashes_are_positional_and_hide_the_text():
    a = "x" * BLOCK_BYTES + "shared content that is long enough" * 2
    b = "y" * BLOCK_BYTES + "shared content that is long enough" * 2
    ha, hb = prompt_block_hashes(a), prompt_block_hashes(b)
    assert len(ha) == len(a.encode()) // BLOCK_BYTES
    assert ha[0] != hb[0] and ha[1:] == hb[1:]  # an early difference, the same later blocks
    assert all("shared" not in h for h in ha) and len(set(map(len, ha))) == 1
    assert prompt_block_hashes("short") == []  # no full block


def test_salt_keeps_lengths_and_sharing_within_a_run_but_not_across_runs():
    specs = take("shared-prefix", 0, 12)
    one, two = run_salt(0, 1), run_salt(0, 2)
    assert one != two and len(one) == 8 and one.isalpha()
    for spec in specs:
        a, b = salted(spec, one), salted(spec, two)
        assert a.prompt_len == b.prompt_len == spec.prompt_len
        assert [m["role"] for m in a.messages] == [m["role"] for m in spec.messages]
        assert prompt_block_hashes(a.prompt)[0] != prompt_block_hashes(b.prompt)[0]
    systems = {salted(s, one).messages[0]["content"] for s in specs}
    assert len(systems) == len({s.messages[0]["content"] for s in specs})  # prefixes still shared


def test_salted_plans_have_the_same_arrivals_and_lengths():
    base = LoadTestConfig(url="http://x", rate=5.0, num_requests=20, workload="chat-short", seed=3)
    plain, a, b = (build_plan(LoadTestConfig(url="http://x", rate=5.0, num_requests=20, workload="chat-short",
                                             seed=3, prompt_salt=salt)) for salt in (None, "aaaaaaaa", "bbbbbbbb"))
    assert build_plan(base).offsets == plain.offsets == a.offsets == b.offsets
    assert [s.prompt_len for s in a.specs] == [s.prompt_len for s in plain.specs]
    assert all(x.prompt != y.prompt for x, y in zip(a.specs, b.specs, strict=True))
    assert a.specs[0].prompt.startswith("aaaaaaaa")
    closed = build_plan(LoadTestConfig(url="http://x", concurrency=2, num_requests=3, prompt_salt="cccccccc"))
    assert next(closed.requests()).prompt.startswith("cccccccc")
