"""Read-through over a ``stack.TierStack``: each key's value from the first tier holding it, decoded by the
caller's function; a damaged value is a counted ``corrupt`` miss and is removed from its tier, a value of another
key, namespace or model a counted ``foreign`` miss, one over the reader's decode bound a ``rejected`` miss kept
for others; hits of a lower tier are promoted into the tiers above."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvshelf.kvstore.errors import BlockTooLargeError, ForeignBlockError, KVShelfError, TierUnavailableError
from kvshelf.kvstore.keys import TierKey
from kvshelf.kvstore.stats import Metric
from kvshelf.kvstore.tiered.codecs import TierSpec
from kvshelf.kvstore.tiered.decode import decode_all
from kvshelf.kvstore.tiered.stack import TierStack

log = logging.getLogger(__name__)
T = TypeVar("T")
Decode = Callable[[bytes, bytes], T]


def read_through(
    stack: TierStack, keys: Sequence[TierKey], model: str, namespace: str, decode: Decode[T], *,
    parallel: bool = False, decode_checked: Decode[T] | None = None,
) -> list[T | None]:
    """``decode``d values of ``keys`` (checked keys) from the first tier holding each, each tier's hits, misses and
    bytes counted under ``namespace`` and ``model`` (the store counts the retrieval as a whole). ``parallel``: large
    batches decode on a few threads (``decode.decode_all``). ``decode_checked``, when given, decodes the values of a
    tier that ``holds_checked_copies`` instead."""
    result: list[T | None] = [None] * len(keys)
    remaining = list(range(len(keys)))
    for index, spec in enumerate(stack.specs):
        if not remaining:
            break
        try:
            values = spec.tier.get_many([keys[j] for j in remaining])
        except TierUnavailableError as exc:
            stack.meter.unavailable(spec.tier.name, exc)
            continue
        checked = decode_checked is not None and spec.tier.holds_checked_copies
        # a checked copy's check is a header parse, all of it Python: threads would only add their start-up
        outcomes = decode_all(decode_checked if checked and decode_checked else decode,
                              [keys[j] for j in remaining], values, parallel=parallel and not checked)
        missed, promote = [], []
        for j, value, outcome in zip(remaining, values, outcomes, strict=True):
            if value is None or isinstance(outcome, BaseException):
                if isinstance(outcome, BaseException):
                    _count_failure(stack, spec, keys[j], outcome, namespace, model)
                missed.append(j)
                continue
            result[j] = outcome
            stack.meter.count(spec.tier.name, namespace, model, Metric.BYTES_READ, len(value))
            promote.append((keys[j], value))
        stack.meter.count(spec.tier.name, namespace, model, Metric.HITS, len(remaining) - len(missed))
        stack.meter.count(spec.tier.name, namespace, model, Metric.MISSES, len(missed))
        if index > 0 and promote:
            stack.promote(index, promote)
        remaining = missed
    return result


def _count_failure(stack: TierStack, spec: TierSpec, key: TierKey, failure: BaseException, namespace: str,
                   model: str) -> None:
    """A value of ``spec``'s tier that did not decode: a counted miss (a damaged value removed from its tier, its pin
    forgotten); a failure that is no ``KVShelfError`` is raised."""
    name = spec.tier.name
    try:
        raise failure
    except ForeignBlockError:
        stack.meter.count(name, namespace, model, Metric.FOREIGN)
    except BlockTooLargeError as exc:  # within the header limits, over this reader's: kept for others
        log.warning("tier %s: not decoding block %s: %s", name, key.hex(), exc)
        stack.meter.count(name, namespace, model, Metric.REJECTED)
    except KVShelfError as exc:
        log.warning("tier %s: dropping damaged block %s: %s", name, key.hex(), exc)
        stack.meter.count(name, namespace, model, Metric.CORRUPT)
        try:
            stack.delete_from(spec, [key])
        except TierUnavailableError as unavailable:
            stack.meter.unavailable(name, unavailable)
        stack.pins.forget([key])
