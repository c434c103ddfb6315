"""A short reliability run: a real server SIGKILLed and restarted, a real Redis stopped and restarted,
while clients put, get and look up. No wrong block, nothing acknowledged before the kill lost."""

from __future__ import annotations

from kvshelf.bench.chaos import run


def test_chaos_run_never_returns_a_wrong_block():
    result = run(json_path=None, seconds=12, clients=4, redis_down_s=2)
    counts = result["counts"]
    assert result["wrong"] == 0
    assert result["acked_before_kill"] > 0
    assert result["readable_after_restart"] == result["acked_before_kill"]
    assert result["recovered_clients"] == 4  # every client worked again after the kill and the Redis restart
    assert counts["get_ok"] > 0 and counts["put_ok"] > result["acked_before_kill"]  # work went on after it
    assert result["ok"]
