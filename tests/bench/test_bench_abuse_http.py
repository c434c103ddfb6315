"""``kvshelf bench abuse --attacks slowhttp,labels``: a short real run against a `kvshelf serve` with /metrics and the
dashboard on. Silent and slow HTTP connections are closed by the server while both surfaces answer and its threads
and fds stay bounded; made-up model names stay within the label bound and a 2 MiB name is INVALID_ARGUMENT.

Latency and RSS figures are not asserted here (timing on a shared machine); the run's own checks print them.
"""

from __future__ import annotations

import json

import pytest
from service_helpers import kvshelf_cli

from kvshelf.bench.abuse_http import http_ports_of


@pytest.mark.slow
def test_slow_http_and_label_attacks_are_bounded(tmp_path):
    path = tmp_path / "abuse.json"
    result = kvshelf_cli("bench", "abuse", "--seconds", "16", "--attacks", "slowhttp,labels", "--json", str(path))
    assert result.returncode in (0, 1), result.stdout + result.stderr  # 1: a latency/RSS figure missed
    under = json.loads(path.read_text())["results"][1]
    assert under["server_alive"] and under["internal_errors"] == 0 and under["wrong_blocks"] == 0
    abuse = under["abuser"]
    kinds = abuse["kinds"]
    assert abuse["ran"] and abuse["accepted"] == 0, kinds
    assert not abuse["unexpected"], abuse["unexpected"]
    # the server closed silent connections (at the read deadline, or the oldest when more came than it reads)
    assert kinds["slow_http"].get("CLOSED", 0) > 0, kinds["slow_http"]
    assert set(kinds["slow_http_scrape"]) == {"OK"} and set(kinds["slow_http_server"]) == {"OK"}, kinds
    assert kinds["labels"].get("OK", 0) >= 50, kinds["labels"]  # a round at least
    assert set(kinds["labels_long"]) == {"INVALID_ARGUMENT"} and set(kinds["labels_scrape"]) == {"OK"}, kinds


def test_http_ports_are_read_from_the_start_up_line():
    line = ("kvshelf serving on 127.0.0.1:40001 (dev mode; metrics on http://127.0.0.1:40002/metrics (no token: "
            "loopback only; all namespaces); dashboard on http://[::1]:40003/ (no token: loopback only))")
    assert http_ports_of(line) == [40002, 40003]
    assert http_ports_of("kvshelf serving on 127.0.0.1:40001 (dev mode)") == []
