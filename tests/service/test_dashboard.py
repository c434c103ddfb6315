"""The admin dashboard over HTTP: its data endpoint follows real traffic of a real ``kvshelf serve``, the access
rules are those of ``/metrics`` (loopback by default; elsewhere a token, 401 without it), bad settings are
``ConfigError``s, and the most reused prefixes are counted within a bound.
The page itself runs in a real browser in ``test_dashboard_browser.py``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
from dashboard_helpers import TOKEN, request, serve_with_dashboard, token_file, traffic
from helpers import FINGERPRINT, key_of, make_block
from service_helpers import free_port, kvshelf_cli, write_tokens
from typer.testing import CliRunner

from kvshelf.kvstore import open_embedded_store
from kvshelf.kvstore.errors import ConfigError
from kvshelf.service.client import RemoteStore
from kvshelf.service.dashboard import DashboardApp, load_asset, serve_dashboard
from kvshelf.service.dashboard_data import (
    MAX_NAME_CHARS,
    MAX_SERIES,
    MODEL_NAME_EXTRA,
    CachedSource,
    ModelNames,
    TierHealth,
    history_points,
    local_snapshot,
    remote_snapshot,
)
from kvshelf.service.hot_prefixes import HotPrefixes
from kvshelf.service.serve import ServeConfig


def _data(port: int, token: str | None = None) -> dict:
    status, _, body = request(f"http://127.0.0.1:{port}/api/data", token=token)
    assert status == 200, body
    return json.loads(body)


def _wait_for(port: int, check, token: str | None = None, timeout_s: float = 10.0) -> dict:  # noqa: ANN001
    """The first snapshot that passes ``check`` (the endpoint answers from a snapshot at most 0.5 s old)."""
    deadline = time.monotonic() + timeout_s
    while True:
        data = _data(port, token)
        if check(data) or time.monotonic() > deadline:
            return data
        time.sleep(0.1)


def _series(data: dict, namespace: str) -> dict:
    (row,) = [s for s in data["series"] if s["namespace"] == namespace]
    return row


def test_data_endpoint_follows_puts_gets_and_lookups(tmp_path, capsys):
    running, port = serve_with_dashboard(tmp_path, capsys)
    try:
        assert f"dashboard on http://127.0.0.1:{port}/ (no token: loopback only)" in running.line
        status, headers, page = request(f"http://127.0.0.1:{port}/")
        assert status == 200 and b"kvshelf admin" in page and headers["Content-Type"].startswith("text/html")
        assert "script-src 'self'" in headers["Content-Security-Policy"]
        for asset in ("dashboard.js", "dashboard.css"):
            assert request(f"http://127.0.0.1:{port}/{asset}")[2] == load_asset(asset)
        before = _data(port)
        assert before["series"] == [] and before["top_prefixes"] == [] and before["scope"] == "every namespace"
        assert {t["name"] for t in before["tiers"]} == {"memory", "disk"}
        assert all(t["blocks"] == 0 and t["bytes"] == 0 for t in before["tiers"])

        keys_a = traffic(running.grpc, "tenant-a", 3)
        traffic(running.grpc, "tenant-b", 1, seed=1)
        after = _wait_for(port, lambda d: len(d["series"]) == 2)
        a = _series(after, "tenant-a")
        assert a["model"] == FINGERPRINT
        assert (a["retrieve_blocks"], a["retrieve_hit_blocks"]) == (4, 3)  # three stored, one never stored
        assert (a["lookup_blocks"], a["lookup_hit_blocks"]) == (3, 3)
        memory = next(t for t in after["tiers"] if t["name"] == "memory")
        assert memory["blocks"] == 4 and memory["bytes"] > 0 and memory["hits"] >= 4
        assert after["events"] >= before["events"] + 4 * 2  # each put: stored in memory and on disk
        top = after["top_prefixes"][0]
        assert top == {"namespace": "tenant-a", "key": keys_a[-1].hex(), "hits": 2, "error": 0, "blocks": 3,
                       "tokens": 12, "last_seen": top["last_seen"]}
        assert abs(top["last_seen"] - time.time()) < 60
        assert request(f"http://127.0.0.1:{port}/nowhere")[0] == 404
        assert request(f"http://127.0.0.1:{port}/api/data", data=b"x=1")[0] == 405
    finally:
        running.close()


def test_namespace_filter_leaves_other_tenants_unnamed(tmp_path, capsys):
    running, port = serve_with_dashboard(tmp_path, capsys, admin_namespaces="tenant-a")
    try:
        traffic(running.grpc, "tenant-a", 2)
        traffic(running.grpc, "secret-project", 2, seed=1)
        data = _wait_for(port, lambda d: d["series"] and d["top_prefixes"])
        body = json.dumps(data)
        assert "tenant-a" in body and "secret-project" not in body
        assert data["scope"] == "namespaces tenant-a"
        assert next(t for t in data["tiers"] if t["name"] == "memory")["blocks"] == 4  # tier totals name no tenant
    finally:
        running.close()


def test_token_401_without_it_then_bearer_and_login_cookie(tmp_path, capsys):
    """A non-loopback bind with a token file: every request needs the token (even one that comes over loopback)."""
    running, port = serve_with_dashboard(tmp_path, capsys, admin_addr="0.0.0.0",
                                         admin_token_file=str(token_file(tmp_path)))
    base = f"http://127.0.0.1:{port}"
    try:
        assert f"dashboard on http://0.0.0.0:{port}/ (bearer token)" in running.line
        traffic(running.grpc, "tenant-a", 1)
        for path in ("/api/data", "/", "/dashboard.js"):
            status, headers, body = request(base + path)
            assert status == 401 and b"tenant-a" not in body, path
            assert headers["WWW-Authenticate"].startswith("Bearer")
        assert b'<form method="post" action="/login">' in request(base + "/")[2]  # the page's 401: a login form
        assert request(base + "/api/data", token="not-the-token")[0] == 401
        assert request(base + "/api/data", token=TOKEN[:-1])[0] == 401
        assert request(base + "/api/data", cookie=f"kvshelf_admin={TOKEN}x")[0] == 401
        assert "tenant-a" in json.dumps(_data(port, TOKEN))

        assert request(base + "/login", data=b"token=wrong")[0] == 401
        status, headers, _ = request(base + "/login", data=f"token={TOKEN}".encode())
        assert status == 303 and headers["Location"] == "/"
        cookie = headers["Set-Cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        status, _, body = request(base + "/api/data", cookie=cookie.split(";", 1)[0])
        assert status == 200 and b"tenant-a" in body
        assert request(base + "/login", data=b"t" * 5000)[0] == 400
    finally:
        running.close()


def test_non_loopback_without_token_is_a_config_error(tmp_path):
    store = open_embedded_store(tmp_path / "data", memory_bytes="1MiB", max_disk_bytes="16MiB")
    try:
        source = CachedSource(lambda: local_snapshot(store))
        with pytest.raises(ConfigError, match="admin-token-file"):
            serve_dashboard(source, 0, "0.0.0.0")
        endpoint = serve_dashboard(source, 0, "0.0.0.0", token=TOKEN)
        try:
            assert request(f"http://127.0.0.1:{endpoint.port}/api/data")[0] == 401
        finally:
            endpoint.close()
    finally:
        store.close()


def test_cli_refuses_public_dashboard_without_token(tmp_path):
    result = kvshelf_cli("serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"),
                         "--admin-port", str(free_port()), "--admin-addr", "0.0.0.0")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert re.fullmatch(r"error: --admin-addr '0\.0\.0\.0' is not a loopback address.*\n", result.stderr)
    assert not (tmp_path / "data").exists()  # refused before the store was opened


@pytest.mark.parametrize(("settings", "message"), [
    ({"admin_port": 70000}, "--admin-port: admin_port must be in"),
    ({"admin_port": -1}, "--admin-port: admin_port must be >= 0"),
    ({"admin_port": "eighty"}, "--admin-port: admin_port must be a number"),
    ({"admin_port": 9100, "metrics_port": 9100}, "--admin-port: 9100 is also --metrics-port"),
])
def test_bad_settings_are_config_errors(settings, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        ServeConfig.from_settings(**settings)


@pytest.mark.parametrize(("args", "why"), [
    (["--admin-token-file", "EMPTY"], "error: --admin-token-file: "),
    (["--admin-token-file", "MISSING"], "error: --admin-token-file: cannot read"),
    (["--admin-namespaces", " , "], "error: --admin-namespaces: no namespace in"),
])
def test_bad_token_file_or_namespaces_is_a_clear_error(tmp_path, args, why):
    (tmp_path / "EMPTY").write_text("\n")
    args = [str(tmp_path / a) if a in ("EMPTY", "MISSING") else a for a in args]
    result = kvshelf_cli("serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"),
                         "--admin-port", str(free_port()), *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(why), result.stderr
    assert not (tmp_path / "data").exists()


def test_remote_snapshot_of_a_token_holder_is_its_namespace(tmp_path, capsys):
    """``kvshelf dashboard``'s source against a real server with tokens: only the token's namespace (its rows, its
    share of each tier, its reused prefixes), never the other tenant's."""
    running, _ = serve_with_dashboard(tmp_path, capsys, tokens_file=str(write_tokens(tmp_path / "tokens.toml")))
    try:
        keys_a = traffic(running.grpc, "tenant-a", 2, token="token-of-tenant-a")
        traffic(running.grpc, "tenant-b", 3, seed=1, token="token-of-tenant-b")
        with RemoteStore(running.grpc, token="token-of-tenant-a", namespace="tenant-a", shared_memory=False) as remote:
            snap = remote_snapshot(remote.stats())
    finally:
        running.close()
    assert snap["scope"] == "namespace tenant-a" and "tenant-b" not in json.dumps(snap)
    assert [(s["namespace"], s["retrieve_blocks"], s["retrieve_hit_blocks"]) for s in snap["series"]] == [
        ("tenant-a", 3, 2)]
    assert next(t for t in snap["tiers"] if t["name"] == "memory")["blocks"] == 2  # its share, not the tier's 5
    assert [p["key"] for p in snap["top_prefixes"]] == [keys_a[-1].hex()]
    assert snap["events"] > 0


def test_hot_prefixes_stay_bounded_and_keep_the_heavy_hitters():
    hot = HotPrefixes(capacity=8)
    heavy = b"h" * 16
    for i in range(2000):
        hot.hit("ns", i.to_bytes(16, "big"), 1)  # 2000 distinct keys, each once
        if i % 4 == 0:
            hot.hit("ns", heavy, 5, 20)  # one key a fifth of the time: more than total / capacity
    assert 6 <= len(hot.top(100)) <= 8  # a full table drops its least counted quarter for a new key
    first = hot.top(1)[0]
    assert first["key"] == heavy.hex() and first["blocks"] == 5 and first["tokens"] == 20
    assert first["hits"] - first["error"] <= 500 <= first["hits"]  # Space-Saving: a bounded overstatement
    late = max(hot.top(100), key=lambda p: p["error"])  # a key that entered after drops: its count starts above them
    assert late["error"] > 0 and late["hits"] == late["error"] + 1
    hot.hit("other", heavy, 1)
    assert [p["namespace"] for p in hot.top(10, frozenset({"other"}))] == ["other"]
    hot.forget("ns")
    assert [p["namespace"] for p in hot.top(10)] == ["other"]
    with pytest.raises(ValueError, match="capacity"):
        HotPrefixes(capacity=0)


def test_data_call_over_many_namespaces_and_a_full_prefix_table(tmp_path):
    """The data endpoint's snapshot and JSON with 8 namespaces x 2 models of counters and a full table of reused
    prefixes (``kvshelf bench dashboard`` times it)."""
    store = open_embedded_store(tmp_path / "data", memory_bytes="16MiB", max_disk_bytes="64MiB")
    try:
        for i in range(16):
            ns, model = f"tenant-{i % 8}", f"model-{i // 8}"
            for tier in ("memory", "disk", "*"):
                for metric in ("hits", "misses", "evictions", "lookup_blocks", "lookup_hit_blocks",
                               "retrieve_blocks", "retrieve_hit_blocks"):
                    store.counters.add(tier, ns, model, metric, 10 + i)
        hot = HotPrefixes()
        for i in range(1000):
            hot.hit(f"tenant-{i % 8}", i.to_bytes(16, "big"), i % 7 + 1)
        app = DashboardApp(lambda: local_snapshot(store, events_seq=lambda: 1234, hot=hot))
        data = json.loads(app.data())
        assert len(data["series"]) == 16
    finally:
        store.close()


def test_bench_dashboard_times_the_data_call(tmp_path):
    from kvshelf.cli import app

    result = CliRunner().invoke(app, ["bench", "dashboard", "--calls", "20", "--json", str(tmp_path / "d.json")])
    assert result.exit_code == 0, result.output
    payload = json.loads((tmp_path / "d.json").read_text())
    assert payload["calls"] == 20 and 0 < payload["median_us"] <= payload["p90_us"]


def _history(port: int, at_least: int, token: str | None = None) -> list[dict]:
    """``/api/history``'s points once it holds ``at_least`` (the server samples every 0.2 s in these tests)."""
    deadline = time.monotonic() + 10
    while True:
        status, headers, body = request(f"http://127.0.0.1:{port}/api/history", token=token)
        assert status == 200 and headers["Content-Type"] == "application/json", body
        points = json.loads(body)["points"]
        if len(points) >= at_least or time.monotonic() > deadline:
            return points
        time.sleep(0.1)


def test_history_endpoint_returns_the_servers_kept_history(tmp_path, capsys):
    """``/api/history``: the points the server keeps (``kvshelf stats --plot`` draws them), oldest first, in the
    page's shape; the same history a dev-mode server returns with ``Stats`` (``kvshelf dashboard --target``)."""
    running, port = serve_with_dashboard(tmp_path, capsys, history_interval=0.2)
    try:
        traffic(running.grpc, "tenant-a", 3)
        traffic(running.grpc, "tenant-b", 1, seed=1)
        points = _history(port, 1)
        deadline = time.monotonic() + 10
        while points[-1]["tiers"]["memory"]["blocks"] != 4 and time.monotonic() < deadline:
            points = _history(port, 1)
        assert len(points) >= 3, points
        assert [p["t"] for p in points] == sorted(p["t"] for p in points)
        last = points[-1]
        assert last["tiers"]["memory"]["blocks"] == 4 and last["tiers"]["disk"]["bytes"] > 0
        assert last["totals"] == {"lookup_blocks": 4, "lookup_hit_blocks": 4, "retrieve_blocks": 6,
                                  "retrieve_hit_blocks": 4}
        assert points[0]["totals"]["retrieve_blocks"] <= last["totals"]["retrieve_blocks"]
        with RemoteStore(running.grpc, shared_memory=False) as remote:
            remote_points = history_points(remote.stats()["history"])
        assert remote_points[0] == points[0] and len(remote_points) >= len(points)
        assert request(f"http://127.0.0.1:{port}/api/history", data=b"x=1")[0] == 405
    finally:
        running.close()


def test_history_of_a_namespace_dashboard_names_no_other_tenant(tmp_path, capsys):
    """A dashboard of some namespaces gets the tiers' usage from the history, not its counts (every tenant's)."""
    running, port = serve_with_dashboard(tmp_path, capsys, history_interval=0.2, admin_namespaces="tenant-a")
    try:
        traffic(running.grpc, "tenant-a", 2)
        traffic(running.grpc, "secret-project", 2, seed=1)
        points = _history(port, 3)
        assert points and all(p["totals"] is None for p in points)
        assert all(t["evictions"] is None for p in points for t in p["tiers"].values())
        assert "secret-project" not in json.dumps(points)
    finally:
        running.close()


@pytest.mark.parametrize("metrics", [False, True], ids=["dashboard-only", "with-metrics"])
def test_snapshot_names_models_times_requests_and_tells_tier_states(tmp_path, capsys, metrics):
    """``/api/data`` names a model by the name its blocks carry (with its geometry), holds the request latency
    histogram of each gRPC method (``/metrics``' own when it is on, else the dashboard's) and each tier's state."""
    settings = {"metrics_port": free_port()} if metrics else {}
    running, port = serve_with_dashboard(tmp_path, capsys, **settings)
    try:
        traffic(running.grpc, "tenant-a", 3, model_name="smollm2-135m")
        data = _wait_for(port, lambda d: d["series"] and d["latency"])
        row = _series(data, "tenant-a")
        assert (row["model"], row["model_name"]) == (FINGERPRINT, "smollm2-135m")
        assert row["model_shape"] == "2 layers, 2 KV heads x 8, float32"
        assert data["totals"]["retrieve_blocks"] == 4 and data["series_total"] == 1
        methods = {m["method"]: m for m in data["latency"]}
        lookup = methods["LookupPrefix"]
        assert lookup["count"] >= 1 and lookup["sum"] > 0
        counts = [n for _, n in lookup["buckets"]]
        assert counts == sorted(counts) and counts[-1] == lookup["count"] and lookup["buckets"][-1][0] is None
        assert all(b is not None and b > 0 for b, _ in lookup["buckets"][:-1])
        assert {(t["name"], t["state"]) for t in data["tiers"]} == {("memory", "up"), ("disk", "up")}
        assert all(t["unavailable"] == 0 and t["corrupt"] == 0 for t in data["tiers"])
        if metrics:  # the same histogram /metrics shows
            status, _, body = request(f"http://127.0.0.1:{running.metrics_port}/metrics")
            scraped = re.search(r'kvshelf_request_seconds_count\{method="LookupPrefix"\} (\S+)', body.decode())
            assert status == 200 and scraped and float(scraped.group(1)) >= lookup["count"]
    finally:
        running.close()


def test_model_names_are_learned_bounded_and_printable(tmp_path):
    """``ModelNames`` learns a fingerprint's name and geometry from the headers of stored blocks, keeps at most its
    capacity of fingerprints (made-up ones cannot grow it), and keeps a name printable and short."""
    store = open_embedded_store(tmp_path / "data", memory_bytes="16MiB", max_disk_bytes="64MiB")
    names = ModelNames(capacity=2)
    stop = names.attach(store)
    try:
        def put(fingerprint: str, name: str | None, seed: int) -> None:
            block = make_block([seed, seed + 1, seed + 2, seed + 3], fingerprint=fingerprint, layers=3,
                               extra={MODEL_NAME_EXTRA: name} if name is not None else None)
            store.put_many([(key_of(block), block)])

        put("fp-a", None, 0)
        assert names.label("fp-a") == {"model_name": None, "model_shape": "3 layers, 2 KV heads x 8, float32"}
        put("fp-a", "Llama\x00-3\n-8B " + "x" * 500, 10)
        name = names.label("fp-a")["model_name"]
        assert name is not None and name.startswith("Llama-3-8B x") and len(name) == MAX_NAME_CHARS
        put("fp-b", "qwen", 20)
        put("fp-c", "made-up", 30)  # a third fingerprint: the table is full
        assert names.label("fp-b")["model_name"] == "qwen"
        assert names.label("fp-c") == {"model_name": None, "model_shape": None}
        put("fp-b", "qwen2.5-7b", 40)  # a known fingerprint renamed: the latest name
        assert names.label("fp-b")["model_name"] == "qwen2.5-7b"
        names.learn("fp-a", "given-name")
        assert names.label("fp-a")["model_name"] == "given-name"
    finally:
        stop()
        store.close()


def test_tier_health_is_degraded_while_failures_are_recent():
    health = TierHealth(window_s=60)
    assert health.state("redis", True, False, 5, now=0) == "up"  # failures before it was first seen: no time known
    assert health.state("redis", True, False, 5, now=10) == "up"
    assert health.state("redis", True, False, 7, now=20) == "degraded"
    assert health.state("redis", True, False, 7, now=79) == "degraded"
    assert health.state("redis", True, False, 7, now=81) == "up"
    assert health.state("redis", False, False, 9, now=90) == "unreachable"
    assert health.state("redis", True, True, 9, now=91) == "damaged"
    assert health.state("disk", True, False, 0, now=91) == "up"


def test_snapshot_carries_the_busiest_series_and_totals_of_all(tmp_path):
    """With more ``(namespace, model)`` rows than ``MAX_SERIES``, a snapshot carries the busiest ones and the
    totals of all: the page's work per poll stays bounded."""
    store = open_embedded_store(tmp_path / "data", memory_bytes="16MiB", max_disk_bytes="64MiB")
    try:
        extra = 50
        for i in range(MAX_SERIES + extra):
            store.counters.add("*", f"tenant-{i}", "model", "lookup_blocks", i + 1)
            store.counters.add("*", f"tenant-{i}", "model", "lookup_hit_blocks", 1)
        snap = local_snapshot(store)
        assert len(snap["series"]) == MAX_SERIES and snap["series_total"] == MAX_SERIES + extra
        assert min(r["lookup_blocks"] for r in snap["series"]) == extra + 1  # the least busy left out
        assert snap["totals"]["lookup_blocks"] == sum(range(1, MAX_SERIES + extra + 1))
        assert snap["totals"]["lookup_hit_blocks"] == MAX_SERIES + extra
    finally:
        store.close()


def test_remote_dashboard_serves_the_servers_history_and_tier_states(tmp_path, capsys):
    """``kvshelf dashboard --target`` of a dev-mode server: ``/api/history`` holds the server's kept history,
    ``/api/data`` its tiers' states, and no latency (the server's ``/metrics`` has it)."""
    running, _ = serve_with_dashboard(tmp_path, capsys, history_interval=0.2)
    proc = subprocess.Popen([sys.executable, "-P", "-c", "from kvshelf.cli import main; main()", "dashboard",
                             "--target", running.grpc, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        traffic(running.grpc, "tenant-a", 2)
        assert proc.stdout is not None
        match = re.search(r"on http://127\.0\.0\.1:(\d+)/", proc.stdout.readline())
        assert match, proc.stderr.read() if proc.poll() is not None and proc.stderr else "no start-up line"
        port = int(match.group(1))
        points = _history(port, 3)
        assert len(points) >= 3 and set(points[-1]["tiers"]) == {"memory", "disk"}
        data = _wait_for(port, lambda d: d["series"])
        assert data["latency"] is None and {t["state"] for t in data["tiers"]} == {"up"}
        assert data["totals"]["lookup_blocks"] == 2
    finally:
        proc.terminate()
        proc.wait(30)
        running.close()
