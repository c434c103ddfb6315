"""``kvshelf bench abuse``: a short real run (a `kvshelf serve` subprocess, an abusive tenant's process, an
honest tenant) writes the JSON of the issue, and the server refuses every abuse with the right status code:
never INTERNAL, never a wrong block, never an accepted bomb or oversized block.

Latency and RSS figures are not asserted here (timing on a shared machine); the run's own checks print them.
"""

from __future__ import annotations

import json

import pytest
from service_helpers import kvshelf_cli

PHASE_FIELDS = {"phase": str, "p50_ms": float, "p99_ms": float, "internal_errors": int, "wrong_blocks": int,
                "server_rss_growth_bytes": int, "per_call_limit_bytes": int}


@pytest.fixture(scope="module")
def abuse_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("abuse") / "abuse.json"
    # 5 s under abuse: streams held for 3 s (idle timeout 1 s + 2), then a 2 s gap with the stream cap free
    result = kvshelf_cli("bench", "abuse", "--seconds", "10", "--idle-timeout", "1", "--tenant-streams", "4",
                         "--strike-burst", "0",  # strikes off: every kind of abuse reaches its own check
                         "--json", str(path))
    return result, path


@pytest.mark.slow
def test_runs_and_writes_the_issue_schema(abuse_run):
    result, path = abuse_run
    assert result.returncode in (0, 1), result.stdout + result.stderr  # 1: a latency/RSS figure missed
    assert "Traceback" not in result.stdout + result.stderr
    data = json.loads(path.read_text())
    assert list(data) == ["results"]
    assert [r["phase"] for r in data["results"]] == ["alone", "under_abuse"]
    for phase in data["results"]:
        for name, kind in PHASE_FIELDS.items():
            assert isinstance(phase[name], kind), (name, phase[name])
        assert phase["per_call_limit_bytes"] == 32 << 20
        assert phase["honest_calls"] > 0 and phase["honest_blocks_verified"] > 0


@pytest.mark.slow
def test_no_internal_error_no_wrong_block(abuse_run):
    _, path = abuse_run
    for phase in json.loads(path.read_text())["results"]:
        assert phase["internal_errors"] == 0, phase
        assert phase["wrong_blocks"] == 0, phase
        assert phase["server_alive"], phase["server_killed_for"]


@pytest.mark.slow
def test_every_abuse_was_made_and_refused_with_its_code(abuse_run):
    _, path = abuse_run
    abuse = json.loads(path.read_text())["results"][1]["abuser"]
    kinds = abuse["kinds"]
    assert abuse["ran"] and abuse["calls"] > 0
    assert abuse["accepted"] == 0, kinds  # no bomb, oversized or malformed put was ever stored
    # codes outside each kind's expected set: at most a client deadline on a loaded machine
    assert all(set(codes) <= {"DEADLINE_EXCEEDED"} for codes in abuse["unexpected"].values()), abuse["unexpected"]
    admission = abuse["refused_at_admission"]  # refused for the stream cap, before the server read the call
    for kind in ("oversized_declared", "oversized_undeclared", "oversized_call", "oversized_message", "bomb",
                 "over_quota_big"):
        # a call over --max-call carries garbage values: the server may end it at the first one (DATA_LOSS)
        refused = kinds[kind].get("RESOURCE_EXHAUSTED", 0) + (kinds[kind].get("DATA_LOSS", 0)
                                                              if kind == "oversized_call" else 0)
        assert refused > admission.get(kind, 0), (kind, kinds[kind], admission)
    for kind in ("malformed", "wrong_key"):
        assert kinds[kind].get("INVALID_ARGUMENT", 0) > 0, (kind, kinds[kind])
    assert kinds["over_quota"].get("RESOURCE_EXHAUSTED", 0) > 0, kinds["over_quota"]
    assert abuse["max_held_bytes"] <= 16 << 20  # the quota, overwrites included


@pytest.mark.slow
def test_memory_attacks_are_refused_or_served_within_the_limits(abuse_run):
    """H1 (messages of 8 MiB padding) is refused for what each message carries besides its data; H2 (a Hadamard
    header past the head-dim limit) is a damaged block; the largest rotated block the limits admit is decoded by
    the abuser as a client, within 128 MiB."""
    _, path = abuse_run
    abuse = json.loads(path.read_text())["results"][1]["abuser"]
    kinds, admission = abuse["kinds"], abuse["refused_at_admission"]
    for kind in ("padded_unknown", "padded_token_ids"):
        assert kinds[kind].get("RESOURCE_EXHAUSTED", 0) > admission.get(kind, 0), (kind, kinds[kind], admission)
    assert kinds["hadamard_bomb"].get("DATA_LOSS", 0) > 0, kinds["hadamard_bomb"]
    assert kinds["hadamard_max"].get("OK", 0) > 0 and kinds["hadamard_read"].get("OK", 0) > 0, kinds
    assert abuse["client_decode_growth"] <= 128 << 20


def abuse_admission(path):
    return json.loads(path.read_text())["results"][1]["abuser"]["refused_at_admission"]


@pytest.mark.slow
def test_streams_beyond_the_tenant_cap_are_refused_and_idle_ones_cut(abuse_run):
    _, path = abuse_run
    kinds = json.loads(path.read_text())["results"][1]["abuser"]["kinds"]
    idle = kinds["idle_stream"]
    # 16 idle streams against a cap of 4: the extra ones are refused at once
    assert idle.get("RESOURCE_EXHAUSTED", 0) >= 12, idle
    assert abuse_admission(path)["idle_stream"] >= 12
    # the server ends idle (1 s) and slow streams itself: not all of them are still open when the abuser lets go
    ended = {c: n for c, n in (*idle.items(), *kinds["slowloris"].items()) if c not in ("HELD", "RESOURCE_EXHAUSTED")}
    assert ended, (idle, kinds["slowloris"])


@pytest.mark.parametrize(("args", "message"), [
    (["--attacks", "streams,nope"], "--attacks must be a comma-separated subset"),
    (["--attacks", "cpu,streams"], "or cpu alone"),
    (["--attacks", "cpu", "--cpu-share", "1.5"], "--cpu-share"),
    (["--max-block", "lots"], "--max-block"),
    (["--quota", "-1MiB"], "--quota"),
])
def test_bad_options_are_one_error_line(args, message):
    result = kvshelf_cli("bench", "abuse", *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_the_cpu_control_burns_its_share_and_calls_nothing(tmp_path):
    path = tmp_path / "cpu.json"
    result = kvshelf_cli("bench", "abuse", "--seconds", "6", "--attacks", "cpu", "--cpu-share", "0.5",
                         "--json", str(path))
    assert result.returncode in (0, 1), result.stdout + result.stderr
    under = json.loads(path.read_text())["results"][1]
    abuse = under["abuser"]
    assert abuse["ran"] and abuse["calls"] == 0 and abuse["kinds"] == {}
    assert abuse["cpu_s"] >= 0.25 * 0.5 * 3, abuse  # 3 s at half a core, with room for a loaded machine
    assert under["honest_calls"] > 0 and under["internal_errors"] == 0 and under["wrong_blocks"] == 0


@pytest.mark.slow
def test_the_elsewhere_control_abuses_a_second_server_between_the_phases(tmp_path):
    path = tmp_path / "elsewhere.json"
    result = kvshelf_cli("bench", "abuse", "--seconds", "6", "--attacks", "bad", "--elsewhere", "--json", str(path))
    assert result.returncode in (0, 1), result.stdout + result.stderr
    assert "with the abuse on a second server of this machine" in " ".join(result.stdout.split())
    results = json.loads(path.read_text())["results"]
    assert [r["phase"] for r in results] == ["alone", "abuse_elsewhere", "under_abuse"]
    control, under = results[1], results[2]
    assert control["abuser"]["ran"] and control["abuser"]["calls"] > 0, control["abuser"]
    assert control["abuser"]["server"]["alive"] and control["abuser"]["server"]["cpu_s"] > 0
    assert control["abuser"]["server"]["address"] != control["server_address"] == under["server_address"]
    assert control["honest_calls"] > 0 and not control["honest_errors"] and control["wrong_blocks"] == 0
    assert under["abuser"]["ran"] and "server" not in under["abuser"]


def test_rss_growth_after_the_first_minute_is_measured_past_that_minutes_peak():
    from kvshelf.bench.abuse import growth_after

    mib = 1 << 20
    flat = [(float(t), (400 + (t % 7) * 5) * mib) for t in range(0, 300)]  # a band that never rises
    assert growth_after(flat) == 0
    creeping = [(float(t), (400 + t // 3) * mib) for t in range(0, 300)]  # +1 MiB every 3 s, all run long
    assert growth_after(creeping) == (400 + 299 // 3 - (400 + 60 // 3)) * mib
    assert growth_after([(float(t), 400 * mib) for t in range(0, 61)]) is None  # nothing after the minute
