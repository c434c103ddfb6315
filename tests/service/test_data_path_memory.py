"""What the bulk data path holds for calls whose data connection never comes, on a real ``kvshelf serve`` (a
subprocess on 127.0.0.1, its values on disk): a ticket costs no read, and one key named many times is read once."""

from __future__ import annotations

import time

import grpc
from helpers import key_of, make_block
from service_helpers import ServeProcess, data_path_call

from kvshelf.kvstore import encode_block
from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.service.bulk.ticket import OP_GET
from kvshelf.service.client import RemoteStore


def rss_bytes(pid: int) -> int:
    """VmRSS of process ``pid``."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def test_gets_never_connected_read_nothing(tmp_path):
    """Two OpenDataPath GETs of one disk-resident ~16 MiB key named 16 times, whose clients take their tickets and
    never connect: the server must not read (and hold) 16 copies per call (+512 MiB); it reads nothing for them."""
    server = ServeProcess("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"), "--memory", "0")
    channel = grpc.insecure_channel(server.address)
    try:
        block = make_block(512, layers=4, heads=8, head_dim=128)
        key, value = key_of(block), encode_block(block, key_of(block))
        assert len(value) > 16 << 20
        with RemoteStore(server.address, shared_memory=False) as store:
            assert store.put_encoded_many([(key, value)]) == 1
            got = store.get_encoded_many([key] * 4)  # warm: the value's pages mapped, the heap grown for one read
            assert isinstance(got[0], bytearray) and all(v == value for v in got)
            del got
        time.sleep(0.5)
        base = rss_bytes(server.proc.pid)
        open_call = data_path_call(channel)
        calls = [open_call(pb.DataPathRequest(op=OP_GET, keys=[key] * 16), timeout=30) for _ in range(2)]
        assert all(next(call).HasField("ticket") for call in calls)  # and never connect
        grown = 0
        for _ in range(15):  # the tickets live 5 s: sample while both calls wait
            time.sleep(0.1)
            grown = max(grown, rss_bytes(server.proc.pid) - base)
        assert grown < 2 * len(value), f"the server grew {grown >> 20} MiB for two tickets never presented"
        for call in calls:
            try:
                for _ in call:
                    pass
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with RemoteStore(server.address, shared_memory=False) as store:  # duplicates answered in order, read once
            got = store.get_encoded_many([key, b"\x01" * 16, key])
            assert [type(v) for v in got] == [bytearray, type(None), bytearray] and got[0] == got[2] == value
    finally:
        channel.close()
        server.stop()
