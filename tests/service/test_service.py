"""The gRPC service on a real server (127.0.0.1, free port) over a real LMDB store in tmp_path."""

from __future__ import annotations

import json
import re
import signal
import struct
import threading

import grpc
import pytest
import xxhash
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers import FINGERPRINT, assert_same_block, key_of, make_block
from service_helpers import TOKENS, ServeProcess, UnreachableTier, self_signed_cert, write_tokens

from kvshelf.kvstore import LMDBTier, MemoryTier, TieredStore, encode_block, open_embedded_store
from kvshelf.kvstore.errors import ConfigError, TierUnavailableError
from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.proto import kvshelf_pb2_grpc as pb_grpc
from kvshelf.proto.generate import PROTO_DIR, generate, generated_versions, stub_contract
from kvshelf.service.auth import scope_tag
from kvshelf.service.client import RemoteStore, RemoteStoreError
from kvshelf.service.serve import ServeConfig, load_config
from kvshelf.service.server import CHUNK_BYTES, MAX_CHUNK_BYTES, TIERS_HEALTH_NAME, ServerLimits, start_server

TOKEN_A, TOKEN_B = list(TOKENS)
MISSING = b"\x00" * 16


@pytest.fixture
def server(tmp_path):
    store = open_embedded_store(tmp_path / "data")
    running = start_server(store, limits=ServerLimits(max_block_bytes=64 << 20, quota_bytes=None))
    yield running
    running.stop(0)
    store.close()


@pytest.fixture
def remote(server):
    with RemoteStore(f"127.0.0.1:{server.port}", namespace="default") as store:
        yield store


@pytest.fixture
def tenant_server(tmp_path):
    from kvshelf.service.auth import TokenTable

    store = open_embedded_store(tmp_path / "data")
    tokens = TokenTable.from_file(write_tokens(tmp_path / "tokens.toml"))
    running = start_server(store, tokens=tokens, limits=ServerLimits(quota_bytes=200_000))
    yield running
    running.stop(0)
    store.close()


def _tenant(server, token: str, namespace: str) -> RemoteStore:
    return RemoteStore(f"127.0.0.1:{server.port}", token=token, namespace=namespace)


def _stub(server) -> tuple[grpc.Channel, pb_grpc.KVShelfStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}",
                                    options=[("grpc.max_send_message_length", 64 << 20)])
    return channel, pb_grpc.KVShelfStub(channel)


def _code(excinfo) -> grpc.StatusCode:
    return excinfo.value.code()


def _still_serving(store: RemoteStore) -> None:
    block = make_block([7, 7, 7], namespace=store.namespace)
    assert store.put_many([(key_of(block), block)]) == 1
    assert_same_block(store.get_many([key_of(block)], fingerprint=FINGERPRINT)[0], block)


def _rewrite_header(value: bytes, **changes: object) -> bytes:
    """Re-encode ``value`` with header fields changed and a *valid* checksum (a well-formed forged block)."""
    magic, version, header_len = struct.unpack_from("<4sHI", value)
    header = json.loads(value[10 : 10 + header_len])
    header.update(changes)
    raw = json.dumps(header, separators=(",", ":")).encode()
    body = struct.pack("<4sHI", magic, version, len(raw)) + raw + value[10 + header_len : -8]
    return body + xxhash.xxh3_64_digest(body)


def _put_request(key: bytes, data: bytes, *, last: bool = True, namespace: str = "") -> pb.PutBlocksRequest:
    return pb.PutBlocksRequest(namespace=namespace, chunk=pb.Chunk(key=key, data=data, last=last))


# -- the contract -------------------------------------------------------------------------------------


def test_committed_stubs_are_not_stale(tmp_path):
    """The committed stubs define what a fresh protoc run on kvshelf.proto defines (messages, fields, methods, the
    type stub's names), whichever grpcio-tools a fresh install resolves: its version stamp is not compared."""
    fresh = tmp_path / "stubs"
    generate(fresh)
    committed, regenerated = stub_contract(PROTO_DIR), stub_contract(fresh)
    for part in ("descriptor", "methods", "pyi"):
        assert committed[part] == regenerated[part], f"proto/ stubs are stale ({part}): run `make proto`"


def test_the_stub_contract_sees_a_changed_proto(tmp_path):
    """A field added to the contract changes what the comparison above compares."""
    proto = tmp_path / "kvshelf.proto"
    proto.write_text((PROTO_DIR / "kvshelf.proto").read_text().replace(
        "message Chunk {", "message Chunk {\n  uint64 added_for_the_test = 99;", 1))
    from grpc_tools import protoc

    out = tmp_path / "changed"
    out.mkdir()
    assert protoc.main(["grpc_tools.protoc", f"-I{tmp_path}", f"--python_out={out}", f"--pyi_out={out}",
                        f"--grpc_python_out={out}", str(proto)]) == 0
    changed, committed = stub_contract(out), stub_contract(PROTO_DIR)
    assert changed["descriptor"] != committed["descriptor"]
    assert "added_for_the_test" in changed["pyi"]["Chunk"] and committed["methods"] == changed["methods"]


def test_committed_stubs_need_no_newer_grpcio_or_protobuf_than_declared():
    """The stubs refuse to import under a grpcio or protobuf older than the one that generated them: that one must
    be the lower bound pyproject.toml declares, or a fresh install resolving the lowest allowed versions breaks."""
    import tomllib

    deps = tomllib.loads((PROTO_DIR.parent / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = dict(re.fullmatch(r"([\w-]+)>=([\d.]+).*", d.split(";")[0].strip()).groups()
                  for d in deps if re.fullmatch(r"([\w-]+)>=([\d.]+).*", d.split(";")[0].strip()))
    grpc_version, pb_version = generated_versions()
    assert floors["grpcio"] == grpc_version and floors["protobuf"] == pb_version, (floors, grpc_version, pb_version)


def test_health_and_reflection(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    check = health_pb2_grpc.HealthStub(channel).Check
    assert check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
    assert check(health_pb2.HealthCheckRequest(service="kvshelf.v1.KVShelf")).status == \
        health_pb2.HealthCheckResponse.SERVING
    assert check(health_pb2.HealthCheckRequest(service=TIERS_HEALTH_NAME)).status == \
        health_pb2.HealthCheckResponse.SERVING
    responses = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"kvshelf.v1.KVShelf", "grpc.health.v1.Health"} <= names
    channel.close()


def test_reflection_v1_beside_v1alpha(server):
    """Tools that speak reflection v1 only (newer grpcurl, Postman) list the services and fetch the contract: the v1
    service answers with the same messages (v1 and v1alpha share field numbers)."""
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    v1 = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                               request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                               response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    listed = list(v1(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
    names = {s.name for r in listed for s in r.list_services_response.service}
    assert {"kvshelf.v1.KVShelf", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= names
    found = list(v1(iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvshelf.v1.KVShelf")]),
                    timeout=10))
    assert found[0].file_descriptor_response.file_descriptor_proto, found[0]
    channel.close()


# -- round trips --------------------------------------------------------------------------------------


def test_round_trip_of_blocks_larger_than_a_chunk(remote):
    big = make_block(300, layers=4, heads=8, head_dim=128)  # ~9.8 MB encoded: three chunks
    small = make_block([1, 2, 3])
    assert len(encode_block(big, key_of(big))) > 2 * CHUNK_BYTES
    entries = [(key_of(big), big), (key_of(small), small)]
    assert remote.put_many(entries) == 2
    got = remote.get_many([key_of(big), MISSING, key_of(small)], fingerprint=FINGERPRINT)
    assert_same_block(got[0], big)
    assert got[1] is None
    assert_same_block(got[2], small)
    assert remote.get_many([key_of(big)], fingerprint="another-model") == [None]


def test_contains_and_lookup_prefix(remote):
    blocks = [make_block([i, i + 1]) for i in range(4)]
    keys = [key_of(b) for b in blocks]
    remote.put_many([(k, b) for k, b in zip(keys, blocks, strict=True) if k != keys[2]])
    assert remote.lookup_prefix(keys, model=FINGERPRINT) == 2
    assert remote.lookup_prefix(keys[:2]) == 2
    assert remote.contains(keys) == [True, True, False, True]
    assert remote.lookup_prefix([]) == 0
    stats = remote.stats()
    assert stats["namespace"] == "default"
    assert stats["lookup_hit_rate"] == pytest.approx(4 / 6)
    assert stats["health"]["status"] == "serving"


def test_delete_pin_unpin_clear(remote, server):
    blocks = [make_block([i, 100 + i]) for i in range(3)]
    keys = [key_of(b) for b in blocks]
    remote.put_many(list(zip(keys, blocks, strict=True)))
    assert remote.pin([keys[0], MISSING]) == 1  # only held blocks are pinned
    assert server.servicer.store.is_pinned(scope_tag("default") + keys[0])
    assert remote.unpin([keys[0], keys[1]]) == 1
    assert not server.servicer.store.is_pinned(scope_tag("default") + keys[0])
    assert remote.delete([keys[0], MISSING]) == 1
    assert remote.contains(keys) == [False, True, True]
    other = RemoteStore(f"127.0.0.1:{server.port}", namespace="other")
    kept = make_block([9, 9], namespace="other")
    other.put_many([(key_of(kept), kept)])
    assert remote.clear() == 2
    assert remote.contains(keys) == [False, False, False]
    assert other.contains([key_of(kept)]) == [True]  # clear removes only its namespace
    other.close()


def test_put_with_pin_pins(remote, server):
    block = make_block([4, 2])
    remote.put_many([(key_of(block), block)], pin=True)
    assert server.servicer.store.is_pinned(scope_tag("default") + key_of(block))


# -- tenants ------------------------------------------------------------------------------------------


def test_tenant_isolation(tenant_server):
    a, b = _tenant(tenant_server, TOKEN_A, "tenant-a"), _tenant(tenant_server, TOKEN_B, "tenant-b")
    block = make_block([5, 6, 7], namespace="tenant-b")
    key = key_of(block)
    assert b.put_many([(key, block)]) == 1
    assert_same_block(b.get_many([key], fingerprint=FINGERPRINT)[0], block)
    # A knows B's key: it can neither read, test, pin, delete nor clear it
    assert a.get_encoded_many([key]) == [None]
    assert a.lookup_prefix([key]) == 0
    assert a.contains([key]) == [False]
    assert a.pin([key]) == 0
    assert a.delete([key]) == 0
    assert a.clear() == 0
    assert b.contains([key]) == [True]
    assert_same_block(b.get_many([key], fingerprint=FINGERPRINT)[0], block)
    # A naming B's namespace, or sending a block encoded for it
    with pytest.raises(RemoteStoreError) as exc:
        a.clear("tenant-b")
    assert exc.value.code == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(RemoteStoreError) as exc:
        a.get_many([key], fingerprint=FINGERPRINT, namespace="tenant-b")
    assert exc.value.code == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(RemoteStoreError) as exc:
        a.put_many([(key, block)])
    assert exc.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "tenant-b" in str(exc.value)
    stats = a.stats()
    assert stats["namespace"] == "tenant-a" and "store" not in stats
    assert all(row["namespace"] == "tenant-a" for row in stats["rows"])
    _still_serving(a)
    a.close()
    b.close()


def test_wrong_or_missing_token_is_unauthenticated(tenant_server):
    for token in ("not-a-known-token", None):
        store = RemoteStore(f"127.0.0.1:{tenant_server.port}", token=token, namespace="tenant-a")
        with pytest.raises(RemoteStoreError) as exc:
            store.lookup_prefix([MISSING])
        assert exc.value.code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(RemoteStoreError) as exc:
            store.put_many([(key_of(make_block([1], namespace="tenant-a")), make_block([1], namespace="tenant-a"))])
        assert exc.value.code == grpc.StatusCode.UNAUTHENTICATED
        store.close()
    _still_serving(_tenant(tenant_server, TOKEN_A, "tenant-a"))


def _unary_contains(tenant_server, metadata):
    channel, stub = _stub(tenant_server)
    try:
        return stub.Contains(pb.KeysRequest(keys=[MISSING]), metadata=metadata, timeout=10)
    finally:
        channel.close()


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer"])
def test_bearer_scheme_is_case_insensitive(tenant_server, scheme):
    """RFC 9110: the auth scheme is case-insensitive; ``bearer <token>`` works as ``Bearer <token>`` does."""
    response = _unary_contains(tenant_server, (("authorization", f"{scheme} {TOKEN_A}"),))
    assert list(response.present) == [False]


def test_two_authorization_headers_are_unauthenticated(tenant_server):
    """Two ``authorization`` headers (auth read the last, fairness the first): refused, on unary and streaming
    calls, naming why; one header still works."""
    two = (("authorization", f"Bearer {TOKEN_A}"), ("authorization", f"Bearer {TOKEN_B}"))
    with pytest.raises(grpc.RpcError) as exc:
        _unary_contains(tenant_server, two)
    assert _code(exc) == grpc.StatusCode.UNAUTHENTICATED and "2 'authorization' headers" in exc.value.details()
    channel, stub = _stub(tenant_server)
    with pytest.raises(grpc.RpcError) as exc:
        list(stub.GetBlocks(pb.GetBlocksRequest(keys=[MISSING]), metadata=two, timeout=10))
    assert _code(exc) == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as exc:
        stub.PutBlocks(iter([_put_request(MISSING, b"x")]), metadata=two, timeout=10)
    assert _code(exc) == grpc.StatusCode.UNAUTHENTICATED
    channel.close()
    for bad in ("Basic abc", "Bearer ", "Bearer"):
        with pytest.raises(grpc.RpcError) as exc:
            _unary_contains(tenant_server, (("authorization", bad),))
        assert _code(exc) == grpc.StatusCode.UNAUTHENTICATED
    _still_serving(_tenant(tenant_server, TOKEN_A, "tenant-a"))


def test_namespace_quota(tenant_server):
    a = _tenant(tenant_server, TOKEN_A, "tenant-a")
    big = make_block(200, layers=2, heads=4, head_dim=64, namespace="tenant-a")  # ~410 KB > the 200 KB quota
    with pytest.raises(RemoteStoreError) as exc:
        a.put_many([(key_of(big), big)])
    assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "quota of 200000 bytes" in str(exc.value)
    assert a.contains([key_of(big)]) == [False]
    _still_serving(a)
    a.close()


# -- bad inputs: a clear status each, and the server keeps serving ------------------------------------


def test_malformed_request(server, remote):
    channel, stub = _stub(server)
    raw = channel.unary_unary("/kvshelf.v1.KVShelf/LookupPrefix")  # no serializers: raw bytes
    with pytest.raises(grpc.RpcError) as exc:
        raw(b"\x12\xff\xff\xff\xff\x0f", timeout=10)  # field 2 claims a 4 GiB length
    assert _code(exc) == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed LookupPrefixRequest" in exc.value.details()
    with pytest.raises(grpc.RpcError) as exc:  # a put message without a chunk
        stub.PutBlocks(iter([pb.PutBlocksRequest(namespace="default")]), timeout=10)
    assert _code(exc) == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as exc:  # a value whose first chunk has no key
        stub.PutBlocks(iter([pb.PutBlocksRequest(chunk=pb.Chunk(data=b"abc", last=True))]), timeout=10)
    assert _code(exc) == grpc.StatusCode.INVALID_ARGUMENT
    assert "must carry its key" in exc.value.details()
    channel.close()
    _still_serving(remote)


def test_key_of_wrong_length(server, remote):
    channel, stub = _stub(server)
    with pytest.raises(grpc.RpcError) as exc:
        stub.LookupPrefix(pb.LookupPrefixRequest(keys=[b"short"]), timeout=10)
    assert _code(exc) == grpc.StatusCode.INVALID_ARGUMENT
    assert "key 0 is 5 bytes" in exc.value.details()
    block = make_block([1, 2])
    with pytest.raises(grpc.RpcError) as exc:
        stub.PutBlocks(iter([_put_request(b"k" * 17, encode_block(block, key_of(block)))]), timeout=10)
    assert _code(exc) == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ConfigError):  # the client checks before sending
        remote.delete([b"short"])
    channel.close()
    _still_serving(remote)


def test_unknown_codec(server, remote):
    block = make_block([3, 4])
    key = key_of(block)
    forged = _rewrite_header(encode_block(block, key), codec="no-such-codec")
    with pytest.raises(RemoteStoreError) as exc:
        remote.put_encoded_many([(key, forged)])
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "no-such-codec" in str(exc.value)
    assert remote.contains([key]) == [False]
    _still_serving(remote)


def test_checksum_failure(server, remote):
    block = make_block([8, 9])
    key = key_of(block)
    value = bytearray(encode_block(block, key))
    value[-20] ^= 0xFF  # a payload byte
    with pytest.raises(RemoteStoreError) as exc:
        remote.put_encoded_many([(key, bytes(value))])
    assert exc.value.code == grpc.StatusCode.DATA_LOSS
    assert "checksum" in str(exc.value)
    other = make_block([1, 1])  # a valid value under another block's key
    with pytest.raises(RemoteStoreError) as exc:
        remote.put_encoded_many([(key, encode_block(other, key_of(other)))])
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert remote.contains([key]) == [False]
    _still_serving(remote)


def test_chunk_stream_ending_early_stores_nothing(server, remote):
    channel, stub = _stub(server)
    done, cut = make_block([10, 11]), make_block([12, 13])
    done_value, cut_value = encode_block(done, key_of(done)), encode_block(cut, key_of(cut))
    requests = [_put_request(key_of(done), done_value),  # a complete value first...
                _put_request(key_of(cut), cut_value[:50], last=False)]  # ...then the stream stops mid-value
    with pytest.raises(grpc.RpcError) as exc:
        stub.PutBlocks(iter(requests), timeout=10)
    assert _code(exc) == grpc.StatusCode.INVALID_ARGUMENT
    assert "ended inside the value" in exc.value.details() and "nothing stored" in exc.value.details()
    assert remote.contains([key_of(done), key_of(cut)]) == [False, False]
    channel.close()
    _still_serving(remote)


def test_oversized_message_and_block(server, remote):
    channel, stub = _stub(server)
    block = make_block([1, 2])
    with pytest.raises(grpc.RpcError) as exc:  # one message beyond the gRPC limit (a chunk 1 MiB over the largest)
        stub.PutBlocks(iter([_put_request(key_of(block), b"x" * (MAX_CHUNK_BYTES + (1 << 20)))]), timeout=20)
    assert _code(exc) == grpc.StatusCode.RESOURCE_EXHAUSTED
    big = pb.PutBlocksRequest(chunk=pb.Chunk(key=key_of(block), data=b"x", total_size=65 << 20))
    with pytest.raises(grpc.RpcError) as exc:  # a value announced beyond the max block size
        stub.PutBlocks(iter([big]), timeout=10)
    assert _code(exc) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max block size" in exc.value.details()
    channel.close()
    _still_serving(remote)


def test_unreachable_tier_at_start_degrades(tmp_path):
    store = TieredStore([MemoryTier(1 << 20), LMDBTier(tmp_path / "lmdb"), UnreachableTier("shared")])
    running = start_server(store)
    try:
        remote = RemoteStore(f"127.0.0.1:{running.port}")
        stats = remote.stats()
        assert stats["health"] == {"status": "degraded", "unavailable_tiers": ["shared"],
                                   "damaged_tiers": []}
        assert [t["available"] for t in stats["tiers"]] == [True, True, False]
        channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
        check = health_pb2_grpc.HealthStub(channel).Check
        assert check(health_pb2.HealthCheckRequest(service=TIERS_HEALTH_NAME)).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
        assert check(health_pb2.HealthCheckRequest(service="kvshelf.v1.KVShelf")).status == \
            health_pb2.HealthCheckResponse.SERVING
        channel.close()
        _still_serving(remote)  # the local tiers serve
        block = make_block([21, 22])
        remote.put_many([(key_of(block), block)])
        assert remote.lookup_prefix([key_of(block)]) == 1
        assert remote.delete([key_of(block)]) == 1
        remote.close()
    finally:
        running.stop(0)
        store.close()


def test_unreachable_server_raises_tier_unavailable(server):
    port = server.port
    server.stop(0)
    with pytest.raises(TierUnavailableError, match=f"127.0.0.1:{port}"):
        RemoteStore(f"127.0.0.1:{port}", connect_timeout_s=0.5)
    store = RemoteStore(f"127.0.0.1:{port}", connect_timeout_s=0, timeout_s=2)
    with pytest.raises(TierUnavailableError):
        store.lookup_prefix([MISSING])
    store.close()


# -- TLS ------------------------------------------------------------------------------------------------


def test_tls(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    store = open_embedded_store(tmp_path / "data")
    running = start_server(store, tls_cert=cert.read_bytes(), tls_key=key.read_bytes())
    try:
        with RemoteStore(f"localhost:{running.port}", tls_ca=cert) as secure:
            _still_serving(secure)
        with pytest.raises(TierUnavailableError):  # plaintext to a TLS port never connects
            RemoteStore(f"127.0.0.1:{running.port}", connect_timeout_s=1)
    finally:
        running.stop(0)
        store.close()


# -- kvshelf serve ------------------------------------------------------------------------------------


def test_config_precedence(tmp_path):
    config = tmp_path / "kvshelf.toml"
    config.write_text('[serve]\nlisten = "127.0.0.1:1111"\nmemory = "1GiB"\nquota = "5MiB"\ngrace = 3\n')
    env = {"KVSHELF_LISTEN": "127.0.0.1:2222", "KVSHELF_MEMORY": "512MiB"}
    got = load_config({"listen": "127.0.0.1:3333", "memory": None}, env=env, config_file=config)
    assert (got.server.listen, got.store.memory_bytes, got.limits.quota_bytes, got.server.grace) == (
        "127.0.0.1:3333", 512 << 20, 5 << 20, 3.0)  # sizes parsed once, into bytes
    assert load_config({}, env={"KVSHELF_CONFIG": str(config)}).server.listen == "127.0.0.1:1111"
    assert load_config({}, env={}) == ServeConfig()
    config.write_text("listn = 'x'\n")
    with pytest.raises(ConfigError, match="unknown setting 'listn'"):
        load_config({}, env={}, config_file=config)
    with pytest.raises(ConfigError, match="tls-key"):
        load_config({"tls_cert": "c.pem"}, env={})


def test_shared_memory_setting_from_every_source(tmp_path):
    assert load_config({}, env={}).server.shared_memory is True
    assert load_config({}, env={"KVSHELF_SHARED_MEMORY": "false"}).server.shared_memory is False
    assert load_config({"shared_memory": True}, env={"KVSHELF_SHARED_MEMORY": "0"}).server.shared_memory is True
    config = tmp_path / "kvshelf.toml"
    config.write_text("shared-memory = false\n")
    assert load_config({}, env={}, config_file=config).server.shared_memory is False
    with pytest.raises(ConfigError, match="KVSHELF_SHARED_MEMORY: shared_memory must be true or false, got 'maybe'"):
        load_config({}, env={"KVSHELF_SHARED_MEMORY": "maybe"})


def test_serve_subprocess_end_to_end_and_sigterm_drain(tmp_path):
    tokens = write_tokens(tmp_path / "tokens.toml")
    proc = ServeProcess("--listen", "127.0.0.1:0", "--memory", "64MiB", "--grace", "30",
                        env={"KVSHELF_DATA_DIR": str(tmp_path / "data"), "KVSHELF_TOKENS_FILE": str(tokens)})
    try:
        assert "tokens" in proc.first_line
        a = RemoteStore(proc.address, token=TOKEN_A, namespace="tenant-a")
        _still_serving(a)
        # an in-flight put: its first chunk is sent, then SIGTERM, then the rest; it must complete
        block = make_block(300, layers=2, heads=4, head_dim=64, namespace="tenant-a")
        key = key_of(block)
        value = encode_block(block, key)
        release = threading.Event()

        def requests():
            yield _put_request(key, value[:1000], last=False, namespace="tenant-a")
            release.wait(60)
            yield pb.PutBlocksRequest(chunk=pb.Chunk(data=value[1000:], last=True))

        channel = grpc.insecure_channel(proc.address)
        grpc.channel_ready_future(channel).result(timeout=30)  # connected: the put starts at once, before SIGTERM
        future = pb_grpc.KVShelfStub(channel).PutBlocks.future(
            requests(), timeout=60, metadata=(("authorization", f"Bearer {TOKEN_A}"),))
        assert a.lookup_prefix([MISSING]) == 0  # the server is up and the put is under way
        proc.proc.send_signal(signal.SIGTERM)
        assert "stopping" in proc.readline()
        release.set()
        assert future.result(timeout=60).stored == 1  # drained, not cut
        assert proc.proc.wait(timeout=60) == 0
        assert "stopped" in proc.proc.stdout.read()
        channel.close()
        a.close()
    finally:
        proc.stop()
    store = open_embedded_store(tmp_path / "data")  # the block is on disk, under the tenant's scope
    got = store.get_many([scope_tag("tenant-a") + key], fingerprint=FINGERPRINT, namespace="tenant-a")
    assert_same_block(got[0], block)
    store.close()


def test_serve_rejects_bad_config(tmp_path):
    with pytest.raises(AssertionError, match="redis"):
        ServeProcess("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"), "--redis", "http://nope")


def test_stats_in_dev_mode_include_the_whole_store(remote):
    block = make_block([1, 2, 3])
    remote.put_many([(key_of(block), block)])
    stats = remote.stats()
    assert stats["store"]["tiers"][0]["blocks"] == 1
    assert stats["tiers"][0]["blocks"] == 1 and stats["usage"]["bytes"] > 0


def test_serve_with_unreachable_redis_starts_degraded(tmp_path):
    """The real Redis tier (kvstore.redis_tier) pointed at a port where nothing listens."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = ServeProcess("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"),
                        "--redis", f"redis://127.0.0.1:{port}/0")
    try:
        with RemoteStore(proc.address) as remote:
            stats = remote.stats()
            assert stats["health"] == {"status": "degraded", "unavailable_tiers": ["redis"], "damaged_tiers": []}
            _still_serving(remote)
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(timeout=60) == 0
    finally:
        proc.stop()
