"""Access to ``/metrics``: loopback by default, a bearer token (401 without it), a namespace filter (other
tenants not even named), and no unauthenticated endpoint on a non-loopback address. Real HTTP requests
(urllib) to a real ``kvshelf serve`` (``serve()`` in a thread, and the CLI in a subprocess)."""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers import FINGERPRINT, key_of, make_block
from service_helpers import free_port as _free_port
from service_helpers import kvshelf_cli
from service_helpers import scrape as _scrape

from kvshelf.kvstore import open_embedded_store
from kvshelf.kvstore.errors import ConfigError
from kvshelf.service.client import RemoteStore
from kvshelf.service.metrics import serve_metrics

TOKEN = "s3cret-metrics-token_0123456789"


def _token_file(tmp_path: Path, token: str = TOKEN) -> Path:
    path = tmp_path / "metrics.token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


def _fill(address: str, namespaces: tuple[str, ...]) -> None:
    """One block per namespace (dev mode: the namespace comes from the request) and a read of it."""
    for ns in namespaces:
        with RemoteStore(address, namespace=ns, shared_memory=False) as remote:
            block = make_block([1, 2, 3, 4], namespace=ns)
            assert remote.put_many([(key_of(block), block)]) == 1
            assert remote.get_many([key_of(block)], fingerprint=FINGERPRINT)[0] is not None


def test_token_required_401_without_200_with(serving, tmp_path):
    running = serving(metrics_token_file=str(_token_file(tmp_path)))
    _fill(running.grpc, ("tenant-a",))
    url = f"http://127.0.0.1:{running.metrics_port}/metrics"
    status, body = _scrape(url)
    assert status == 401 and "tenant-a" not in body
    assert _scrape(url, "not-the-token")[0] == 401
    assert _scrape(url, TOKEN[:-1])[0] == 401
    status, body = _scrape(url, TOKEN)
    assert status == 200
    assert f'kvshelf_retrieve_hit_blocks_total{{model="{FINGERPRINT}",namespace="tenant-a"}} 1.0' in body
    assert f"metrics on http://127.0.0.1:{running.metrics_port}/metrics (bearer token" in running.line


def test_namespace_filter_leaves_other_tenants_unnamed(serving):
    running = serving(metrics_namespaces="tenant-a, tenant-c")
    _fill(running.grpc, ("tenant-a", "tenant-b", "secret-project"))
    status, body = _scrape(f"http://127.0.0.1:{running.metrics_port}/metrics")
    assert status == 200
    assert 'namespace="tenant-a"' in body
    assert "tenant-b" not in body and "secret-project" not in body
    assert 'kvshelf_tier_bytes{tier="disk"}' in body  # tier totals name no tenant: still there
    assert "namespaces tenant-a, tenant-c" in running.line


def test_default_binds_loopback_only(serving):
    running = serving()
    assert f"metrics on http://127.0.0.1:{running.metrics_port}/metrics (no token: loopback only" in running.line
    with open("/proc/net/tcp") as f:  # the listening socket (state 0A), by local address
        listening = [line.split()[1] for line in f.read().splitlines()[1:] if line.split()[3] == "0A"]
    (local,) = [addr for addr in listening if int(addr.split(":")[1], 16) == running.metrics_port]
    assert local.split(":")[0] == "0100007F"  # 127.0.0.1, not 0.0.0.0
    assert _scrape(f"http://127.0.0.1:{running.metrics_port}/metrics")[0] == 200


def test_serve_metrics_port_zero_and_close(tmp_path):
    store = open_embedded_store(tmp_path / "data", memory_bytes="1MiB", max_disk_bytes="16MiB")
    endpoint = serve_metrics(store, 0, token=TOKEN, namespaces={"tenant-a"})
    try:
        assert endpoint.host == "127.0.0.1" and endpoint.port > 0
        assert _scrape(endpoint.url)[0] == 401
        assert _scrape(endpoint.url, TOKEN)[0] == 200
    finally:
        endpoint.close()
        store.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(endpoint.url, timeout=5)


def test_non_loopback_without_token_is_refused(tmp_path):
    store = open_embedded_store(tmp_path / "data", memory_bytes="1MiB", max_disk_bytes="16MiB")
    try:
        with pytest.raises(ConfigError, match="metrics-token-file"):
            serve_metrics(store, 0, "0.0.0.0")
        endpoint = serve_metrics(store, 0, "0.0.0.0", token=TOKEN)  # with a token: allowed
        assert _scrape(f"http://127.0.0.1:{endpoint.port}/metrics")[0] == 401
        endpoint.close()
    finally:
        store.close()


def test_cli_refuses_public_metrics_without_token(tmp_path):
    result = kvshelf_cli("serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"),
                         "--metrics-port", str(_free_port()), "--metrics-addr", "0.0.0.0")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert re.fullmatch(r"error: --metrics-addr '0\.0\.0\.0' is not a loopback address.*\n", result.stderr)
    assert not (tmp_path / "data").exists()  # refused before the store was opened


@pytest.mark.parametrize(("content", "why"), [("", "is empty"), ("two words", "no spaces")])
def test_bad_token_file_is_a_clear_error(tmp_path, content, why):
    path = tmp_path / "metrics.token"
    path.write_text(content)
    result = kvshelf_cli("serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"),
                         "--metrics-port", str(_free_port()), "--metrics-token-file", str(path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: --metrics-token-file") and why in result.stderr
