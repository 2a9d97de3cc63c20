"""The node activity board: a step's `node_busy` is the mean number of the node's other
engines that stepped during it, through a real shared file, and an engine that is gone
never counts as busy."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest

from tests.engine_support import make_engine_fixture  # noqa: F401
from workers.engine import SamplingParams
from workers.engine.node_activity import BUSY_S, NUM_SLOTS, PID, SINCE, NodeActivity, board_path


@pytest.fixture
def boards(tmp_path):
    made = []

    def make(node="node-a"):
        board = NodeActivity(node, str(tmp_path))
        made.append(board)
        return board

    yield make
    for board in made:
        board.close()


def test_alone_a_step_sees_no_one(boards):
    a = boards()
    a.begin()
    time.sleep(0.01)
    assert a.end() == 0.0


def test_a_step_inside_anothers_counts_it_busy_the_whole_time(boards):
    a, b = boards(), boards()
    a.begin()
    time.sleep(0.01)
    b.begin()
    time.sleep(0.02)
    assert b.end() == pytest.approx(1.0)  # a stepped all through b's step
    time.sleep(0.01)
    busy = a.end()
    assert 0.0 < busy < 1.0  # b stepped for part of a's step


def test_boards_of_other_nodes_do_not_see_each_other(boards):
    a, b = boards("node-a"), boards("node-b")
    assert a.path != b.path
    b.begin()
    a.begin()
    time.sleep(0.01)
    assert a.end() == 0.0
    b.end()


def test_the_board_is_private_and_names_no_node(boards):
    a = boards("secret-node-id")
    assert stat.S_IMODE(os.stat(a.path).st_mode) == 0o600
    assert "secret" not in a.path.name


def test_a_closed_slot_is_free_again_and_idle(boards):
    a = boards()
    a.begin()
    slot = a._slot
    a.close()
    assert a.end() == 0.0  # a step that ends after close writes nothing
    b = boards()
    assert b._slot == slot
    b.begin()
    time.sleep(0.005)
    assert b.end() == 0.0


def test_a_slot_of_a_process_that_is_gone_is_reclaimed_and_not_busy(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(gone.stdout)
    first = NodeActivity("node-a", str(tmp_path))
    first._board[1] = (dead_pid, 1.0, 5.0, time.monotonic())  # died mid-step
    try:
        first._sweep(time.monotonic())
        assert first._board[1, PID] == 0 and first._board[1, SINCE] == 0 and first._board[1, BUSY_S] == 0
        first.begin()
        time.sleep(0.005)
        assert first.end() == 0.0
    finally:
        first.close()


def test_a_full_board_says_so(tmp_path):
    made = [NodeActivity("node-a", str(tmp_path)) for _ in range(NUM_SLOTS)]
    try:
        with pytest.raises(RuntimeError, match="no free slot"):
            NodeActivity("node-a", str(tmp_path))
    finally:
        for board in made:
            board.close()


def test_the_last_engine_of_a_node_removes_the_board(tmp_path):
    a, b = NodeActivity("node-a", str(tmp_path)), NodeActivity("node-a", str(tmp_path))
    a.close()
    assert a.path.exists()  # b still has a slot
    b.close()
    assert not a.path.exists()
    c = NodeActivity("node-a", str(tmp_path))  # a fresh board
    assert c.path.exists() and c._slot == 0
    c.close()


def test_board_path_is_per_node(tmp_path):
    assert board_path("x", str(tmp_path)) != board_path("y", str(tmp_path))
    assert board_path("x", str(tmp_path)) == board_path("x", str(tmp_path))


def test_an_engine_records_its_neighbours_steps(make_engine, tmp_path):  # noqa: F811
    engine = make_engine()
    neighbour = NodeActivity("node-a", str(tmp_path))
    engine.node_activity = NodeActivity("node-a", str(tmp_path))
    try:
        neighbour.begin()  # another engine on the node steps all through these
        engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        neighbour.end()
        busy = [r.node_busy for r in engine.step_records if r.num_prefill_tokens or r.num_decode_seqs]
        assert busy and all(b == pytest.approx(1.0) for b in busy)
    finally:
        engine.node_activity.close()
        engine.node_activity = None
        neighbour.close()
