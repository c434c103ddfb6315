"""``kvshelf bench abuse --attacks subscriptions,replay``: the vLLM-format KV events attacks in a short real run (a
``kvshelf serve`` subprocess publishing on two bound ZeroMQ endpoints, the abuser's process of raw ZeroMQ peers, the
honest tenant). Subscription floods and oversized frames are dropped, every replay request gets an answer that ends,
malformed ones the end marker alone; never INTERNAL, never a wrong or lost block, the server (and its publisher
process, counted in its RSS) alive, and after the attack an honest subscriber gets a live event and a replay its end
marker.

Latency and RSS figures are not asserted here (timing on a shared machine); the run's own checks print them.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest
from service_helpers import kvshelf_cli

from kvshelf.bench.abuse import ABUSER_NS, ABUSER_TOKEN, HONEST_NS, HONEST_TOKEN, AbuseSettings, ServerProcess
from kvshelf.bench.abuse_events import EVENT_ATTACKS, events_ports_of, serve_args
from kvshelf.bench.abuser import ATTACKS


@pytest.mark.slow
def test_subscription_and_replay_attacks_are_refused_and_the_listeners_live(tmp_path: Path) -> None:
    path = tmp_path / "abuse.json"
    result = kvshelf_cli("bench", "abuse", "--seconds", "20", "--attacks", "subscriptions,replay", "--json", str(path))
    assert result.returncode in (0, 1), result.stdout + result.stderr  # 1: a latency/RSS figure missed
    assert "Traceback" not in result.stdout + result.stderr
    phases = json.loads(path.read_text())["results"]
    for phase in phases:
        assert phase["internal_errors"] == 0 and phase["wrong_blocks"] == 0 and phase["honest_misses"] == 0, phase
        assert phase["server_alive"], phase["server_killed_for"]
        assert not phase["honest_errors"], phase["honest_errors"]
    under = phases[-1]
    abuse = under["abuser"]
    kinds = abuse["kinds"]
    assert abuse["ran"] and abuse["accepted"] == 0, kinds
    # the one code outside what is expected that this test lets pass: a replay answered later than 10 s while the
    # subscriptions flood the publisher on this shared 2-core machine (the run's table shows it; a latency, not a
    # refusal gone wrong)
    unexpected = abuse["unexpected"]
    assert all(k.startswith("replay_") and set(codes) == {"NO_END"} for k, codes in unexpected.items()), unexpected
    # the publisher dropped flooding peers and every oversized frame before reading it
    assert kinds["events_subscriptions"].get("DROPPED", 0) > 0, kinds["events_subscriptions"]
    assert sum(kinds["events_big_frame"].values()) > 0 and sum(kinds["events_big_subscription"].values()) > 0, kinds
    # every replay request read was answered with an end (none NO_END: not unexpected), or its connection dropped by
    # the publisher's memory guard while the subscriptions flood it; requests never read, floods, a burst past the
    # replay jobs, requests without a topic, malformed ones (the end marker alone, never batches)
    assert kinds["replay_unread"].get("NOT_READ", 0) > 0, kinds
    # in a 20 s run the memory guard may drop the flooding peers before the flood or the burst start (both wait for
    # a known sequence): of the requests sent, each got its end or its connection dropped
    sent = ("replay_flood", "replay_burst", "replay_no_topic", "replay_malformed")
    assert sum(sum(kinds.get(k, {}).values()) for k in sent) > 0, kinds
    assert sum(kinds.get(k, {}).get(code, 0) for k in sent for code in ("END", "END_ALONE", "DROPPED")) > 0, kinds
    assert set(kinds["replay_malformed"]) <= {"END_ALONE", "DROPPED"}, kinds
    listeners = under["events_listeners"]
    assert listeners["live_event_s"] is not None and listeners["replay"] == "END", listeners
    assert under["events_publisher_bound_bytes"] > 0


def test_the_server_rss_counts_the_events_publisher_process(tmp_path: Path) -> None:
    """The bench's server memory is ``kvshelf serve``'s and its KV events publisher process's together."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{HONEST_TOKEN}" = "{HONEST_NS}"\n"{ABUSER_TOKEN}" = "{ABUSER_NS}"\n')
    server = ServerProcess(AbuseSettings(attacks=("replay",)).serve_args(tmp_path / "data", tokens))
    try:
        server.wait_ready()
        assert len(server.events_ports) == 2
        pids = server.processes()
        assert pids[0] == server.proc.pid and len(pids) >= 2, pids  # the publisher is a child of serve
        alone = int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pids[0]}/status").read_text()).group(1)) * 1024
        memory = server.memory()
        assert memory is not None and memory[0] > alone + (8 << 20), (memory, alone)
    finally:
        server.kill()


def test_the_events_attacks_start_the_server_with_its_endpoints() -> None:
    args = serve_args(["streams", "replay"])
    assert args[0] == "--kv-events-endpoint" and args[2] == "--kv-events-replay-endpoint"
    ports = events_ports_of(args)
    assert len(ports) == 2 and all(0 < p < 65536 for p in ports)
    assert serve_args(["streams", "slowhttp"]) == [] and events_ports_of(["--listen", "127.0.0.1:0"]) == []
    with tempfile.TemporaryDirectory() as tmp:
        assert "--kv-events-endpoint" in AbuseSettings(attacks=EVENT_ATTACKS).serve_args(Path(tmp), Path(tmp))
        assert "--kv-events-endpoint" not in AbuseSettings().serve_args(Path(tmp), Path(tmp))


def test_the_attacks_help_names_every_attack() -> None:
    result = kvshelf_cli("bench", "abuse", "--help")
    assert result.returncode == 0, result.stderr
    words = set(re.findall(r"[a-z]+", result.stdout))
    missing = [attack for attack in ATTACKS if attack not in words]
    assert not missing, f"--attacks help does not name {missing}"
    assert {"subscriptions", "replay"} <= set(ATTACKS)
