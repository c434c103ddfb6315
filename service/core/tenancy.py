"""A request's keys and model fingerprint checked, and its keys scoped to its tenant: a tier key is
``scope(scope_tag(namespace), key)`` (``kvstore.keys``), so one namespace can never name another's blocks."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from kvshelf.kvstore.keys import KEY_BYTES, BlockKey, ScopedKey, scope, scope_tag
from kvshelf.kvstore.limits import MAX_FINGERPRINT_CHARS
from kvshelf.service.core.limits import MAX_KEYS_PER_CALL
from kvshelf.service.status import fail


def check_keys(keys: Sequence[bytes]) -> None:
    """INVALID_ARGUMENT when a call names more than ``MAX_KEYS_PER_CALL`` keys or a key is not ``KEY_BYTES`` long."""
    if len(keys) > MAX_KEYS_PER_CALL:
        fail(grpc.StatusCode.INVALID_ARGUMENT, f"{len(keys)} keys in one call; the limit is {MAX_KEYS_PER_CALL}")
    for i, key in enumerate(keys):
        if len(key) != KEY_BYTES:
            fail(grpc.StatusCode.INVALID_ARGUMENT, f"key {i} is {len(key)} bytes; block keys are {KEY_BYTES} bytes")


def check_model(model: str, field: str) -> None:
    """INVALID_ARGUMENT when a request's model fingerprint is longer than any block's can be."""
    if len(model) > MAX_FINGERPRINT_CHARS:
        fail(grpc.StatusCode.INVALID_ARGUMENT,
             f"{field} of {len(model)} characters: a model fingerprint is at most {MAX_FINGERPRINT_CHARS}")


def scope_keys(namespace: str, keys: Sequence[bytes]) -> list[ScopedKey]:
    """``keys`` (checked) as the tier keys of ``namespace``."""
    check_keys(keys)
    tag = scope_tag(namespace)
    return [scope(tag, BlockKey(key)) for key in keys]
