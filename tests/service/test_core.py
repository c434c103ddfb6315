"""The service core (``service/core/``) without a transport: a put admitted, verified and committed, then served,
under the same rules and errors as the gRPC streams and the data path that call it."""

from __future__ import annotations

import grpc
import pytest
from helpers import key_of, make_block

from kvshelf.kvstore import MemoryTier, TieredStore, encode_block
from kvshelf.service.bulk.transport import receive_value
from kvshelf.service.core.service import ServiceCore
from kvshelf.service.events import EventHub, open_event_log
from kvshelf.service.hot_prefixes import HotPrefixes
from kvshelf.service.server import ServerLimits
from kvshelf.service.status import status_of


@pytest.fixture
def core():
    store = TieredStore([MemoryTier(64 << 20)])
    events = EventHub(store, open_event_log(None))
    yield ServiceCore(store, ServerLimits(quota_bytes=1 << 20, max_call_bytes=4 << 20), events, HotPrefixes())
    events.close()
    store.close()


def _fails(fn, code: grpc.StatusCode) -> str:
    with pytest.raises(Exception) as caught:
        fn()
    got, message = status_of(caught.value)
    assert got == code, message
    return message


def test_put_then_get_through_the_core(core):
    block = make_block(namespace="team")
    key, value = key_of(block), encode_block(block, key_of(block))
    call = core.put_call("team")
    try:
        call.reserve_declared([(key, len(value))])
        header = core.verify("team", key, value)
        assert core.commit(call, [(key, value)], [header], False, lambda: True) == (1, 1)
    finally:
        call.close()
    assert core.inflight.used() == 0  # everything given back
    served = list(core.served(core.scope("team", [key, key]), "team", None, ()))
    assert [(i, v) for i, _, v in served] == [(0, value), (1, value)]


def test_the_core_refuses_with_the_transports_errors(core):
    block = make_block(namespace="team")
    key, value = key_of(block), encode_block(block, key_of(block))
    assert "encoded for namespace 'team'" in _fails(lambda: core.verify("other", key, value),
                                                    grpc.StatusCode.PERMISSION_DENIED)
    assert "is damaged" in _fails(lambda: core.verify("team", key, value[:-1] + bytes([value[-1] ^ 1])),
                                  grpc.StatusCode.DATA_LOSS)
    call = core.put_call("team")
    try:
        _fails(lambda: call.reserve_declared([(key, 2 << 20)]), grpc.StatusCode.RESOURCE_EXHAUSTED)  # the quota
        header = core.verify("team", key, value)
        assert "nothing stored" in _fails(lambda: core.commit(call, [(key, value)], [header], False, lambda: False),
                                          grpc.StatusCode.CANCELLED)
    finally:
        call.close()
    assert core.inflight.used() == 0
    _fails(lambda: core.scope("team", [b"short"]), grpc.StatusCode.INVALID_ARGUMENT)


def test_a_value_received_in_place_is_kept_by_the_memory_tier_as_is(core):
    block = make_block(namespace="team")
    key, encoded = key_of(block), encode_block(block, key_of(block))
    value, view = receive_value(len(encoded))
    view[:] = encoded
    del view
    assert value == encoded
    call = core.put_call("team")
    try:
        core.commit(call, [(key, value)], [core.verify("team", key, value)], False, lambda: True)
    finally:
        call.close()
    stored = core.store.specs[0].tier.get_many(core.scope("team", [key]))[0]
    assert stored is value or type(value) is not bytes  # bytes where CPython allows: no copy
