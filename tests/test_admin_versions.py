"""Workload profile versions: DELETE and If-Match on ControlPlaneCore and the admin helpers.

The HTTP path (ETag headers, 409/404 over a real Serve app) is in tests/router_http/test_api.py.
"""

from __future__ import annotations

import pickle
import threading

import pytest

from router import admin
from router.control_plane import (
    ControlPlaneCore,
    DefaultWorkloadRequired,
    ProfileChangeRefused,
    UnknownWorkload,
    VersionConflict,
)
from router.errors import APIError

LOCAL = {"mode": "local"}


@pytest.fixture()
def cp() -> ControlPlaneCore:
    return ControlPlaneCore({"rag": {"mode": "disagg"}})


def test_set_with_the_current_version_writes_and_a_stale_one_changes_nothing(cp):
    version = cp.version
    assert cp.set_profile("rag", LOCAL, expected_version=version) == version + 1
    written = cp.get_profiles()
    with pytest.raises(VersionConflict) as info:
        cp.set_profile("rag", {"mode": "disagg"}, expected_version=version)  # stale now
    assert info.value.current_version == version + 1 and info.value.workload == "rag"
    assert cp.get_profiles() == written and written[1]["rag"]["mode"] == "local"
    assert cp.set_profile("rag", {"mode": "disagg"}) == version + 2  # no expectation: as before


def test_delete_bumps_the_version_and_the_poll_resends_profiles(cp):
    version = cp.version
    assert cp.delete_profile("rag", expected_version=version) == version + 1
    assert set(cp.get_profiles()[1]) == {"default"}
    assert set(cp.get_state(version).profiles) == {"default"}


def test_delete_refusals_change_nothing(cp):
    version, before = cp.get_profiles()
    with pytest.raises(DefaultWorkloadRequired):
        cp.delete_profile("default")
    with pytest.raises(DefaultWorkloadRequired):  # refused whatever the version
        cp.delete_profile("default", expected_version=version)
    with pytest.raises(UnknownWorkload) as info:
        cp.delete_profile("nope", expected_version=version)
    assert info.value.current_version == version
    with pytest.raises(VersionConflict):  # a stale writer hears it is stale first
        cp.delete_profile("nope", expected_version=version - 1)
    with pytest.raises(VersionConflict):
        cp.delete_profile("rag", expected_version=version + 1)
    assert cp.get_profiles() == (version, before)


def test_racing_writers_with_one_version_have_one_winner(cp):
    """Serve runs the ControlPlane's sync methods on a thread pool; the compare and the
    write must be one step, or two routers' writes would both pass the check."""
    version, num_writers = cp.version, 16
    outcomes: list[str] = []
    start = threading.Barrier(num_writers)

    def write(i: int) -> None:
        start.wait()
        try:
            cp.set_profile("rag", {"mode": "local", "max_prefill_queue": i}, expected_version=version)
            outcomes.append("won")
        except VersionConflict:
            outcomes.append("conflict")

    writers = [threading.Thread(target=write, args=(i,)) for i in range(num_writers)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    assert sorted(outcomes) == ["conflict"] * (num_writers - 1) + ["won"]
    assert cp.version == version + 1


@pytest.mark.parametrize("refused", [VersionConflict("rag", 7), UnknownWorkload("x", 7),
                                     DefaultWorkloadRequired("default", 7)])
def test_refusals_survive_pickling(refused):
    """They travel back from the ControlPlane replica to the router through Ray."""
    copy = pickle.loads(pickle.dumps(refused))
    assert type(copy) is type(refused) and (copy.workload, copy.current_version) == (refused.workload, 7)


@pytest.mark.parametrize(("refused", "status", "code"), [
    (VersionConflict("rag", 7), 409, "version_conflict"),
    (UnknownWorkload("x", 7), 404, "workload_not_found"),
    (DefaultWorkloadRequired("default", 7), 400, "default_workload_required"),
])
def test_refusals_map_to_openai_errors(refused: ProfileChangeRefused, status, code):
    error = admin.refused_error(refused)
    assert (error.status, error.code) == (status, code)


def test_conflict_message_gives_the_current_version_and_what_to_do():
    message = admin.refused_error(VersionConflict("rag", 12)).message
    assert "12" in message and "GET /admin/workloads" in message and "retry" in message


@pytest.mark.parametrize(("header", "version"), [(None, None), ("12", 12), ('"12"', 12), (' "0" ', 0)])
def test_if_match_accepts_a_bare_or_quoted_version(header, version):
    assert admin.parse_if_match(header) == version


@pytest.mark.parametrize("header", ["", "*", "abc", "-1", "1.5", 'W/"3"', '"3', "１２", "9" * 40])
def test_if_match_that_is_not_a_version_is_a_400_naming_it(header):
    with pytest.raises(APIError) as info:
        admin.parse_if_match(header)
    assert info.value.status == 400 and info.value.param == "If-Match" and "If-Match" in info.value.message


def test_etag_is_the_quoted_version():
    assert admin.etag(5) == {"etag": '"5"'}
