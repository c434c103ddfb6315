"""``kvshelf bench abuse --attacks dupkeys,silentdata``: the bulk data path's attacks in a short real run (a
``kvshelf serve`` subprocess, the abuser's process, the honest tenant): gets naming one key many times are answered
right (over gRPC and the data path), tickets never presented end at their expiry, silent data connections are ended
by the hello's deadline or refused; never INTERNAL, never a wrong block, the server alive.

Latency and RSS figures are not asserted here (timing on a shared machine); the run's own checks print them.
"""

from __future__ import annotations

import json

import pytest
from service_helpers import kvshelf_cli


@pytest.fixture(scope="module")
def abuse_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("abuse") / "abuse.json"
    result = kvshelf_cli("bench", "abuse", "--seconds", "10", "--idle-timeout", "1", "--tenant-streams", "4",
                         "--strike-burst", "0", "--attacks", "dupkeys,silentdata", "--json", str(path))
    return result, path


@pytest.mark.slow
def test_data_path_attacks_are_answered_or_refused(abuse_run):
    result, path = abuse_run
    assert result.returncode in (0, 1), result.stdout + result.stderr  # 1: a latency/RSS figure missed
    assert "Traceback" not in result.stdout + result.stderr
    phases = json.loads(path.read_text())["results"]
    for phase in phases:
        assert phase["internal_errors"] == 0 and phase["wrong_blocks"] == 0, phase
        assert phase["server_alive"], phase["server_killed_for"]
    abuse = phases[-1]["abuser"]
    kinds = abuse["kinds"]
    assert abuse["ran"] and abuse["accepted"] == 0, kinds
    assert all(set(codes) <= {"DEADLINE_EXCEEDED"} for codes in abuse["unexpected"].values()), abuse["unexpected"]
    assert "WRONG" not in kinds["dupkeys_grpc"] and kinds["dupkeys_grpc"].get("OK", 0) > 0, kinds
    assert "WRONG" not in kinds["dupkeys_datapath"] and kinds["dupkeys_datapath"].get("OK", 0) > 0, kinds
    assert kinds["dupkeys_unclaimed"].get("DEADLINE_EXCEEDED", 0) > 0, kinds  # each ended at its ticket's expiry
    assert kinds["silent_data"].get("DEADLINE_EXCEEDED", 0) > 0, kinds  # the hello's deadline ends them
