"""Replays of the vLLM-format KV event stream (``kvstore.vllm_events``), in its socket process
(``kvstore.vllm_events_worker``): each topic's buffered batches (``TopicLog``), the requests a DEALER peer sends the
ROUTER (``parse_replay_request``) and the jobs that answer them (``Replays``): one per peer, ``REPLAY_JOBS`` at once,
``REPLAY_ROUND`` messages per loop shared by the jobs; a peer that does not read stops its own job (given up after
``REPLAY_STALL_S``, then answered with the end marker alone for ``STALLED_PEER_S``), never another's.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import zmq

from kvshelf.kvstore.vllm_event_wire import END_SEQ, KVEventsSettings

#: longest topic a replay request may name, and about the longest subscription (a namespace of 1,024 ASCII characters
#: and a topic fit)
MAX_TOPIC_BYTES = 4096
#: replay jobs at once (one per peer), replay messages sent per loop, requests read per loop
REPLAY_JOBS = 16
REPLAY_ROUND = 32
REQUESTS_PER_ROUND = 64
#: a replay job whose peer reads nothing for this long is given up
REPLAY_STALL_S = 5.0
#: a peer whose replay was given up gets only end markers for this long (a peer that never reads and asks again
#: would otherwise hold a job for ever), and how many such peers are remembered (the oldest forgotten first)
STALLED_PEER_S = 60.0
STALLED_PEERS = 4096
_SENT, _AGAIN, _GONE = range(3)


def parse_replay_request(frames: list[bytes]) -> tuple[int, bytes | None] | None:
    """``(start sequence, topic or None)`` of a replay request's frames (after the peer's identity), or None when
    malformed. A REQ client's empty delimiter frame is skipped; then the 8-byte big-endian start and, optionally, the
    topic (``MAX_TOPIC_BYTES`` at most)."""
    if frames and frames[0] == b"":
        frames = frames[1:]
    if not 1 <= len(frames) <= 2 or len(frames[0]) != 8:
        return None
    topic = frames[1] if len(frames) == 2 else None
    if topic is not None and len(topic) > MAX_TOPIC_BYTES:
        return None
    return int.from_bytes(frames[0], "big"), topic


@dataclass
class TopicLog:
    """One topic's sequence and its buffered batches ``(seq, payload frame, bytes)``, oldest first."""

    next_seq: int = 0
    entries: deque[tuple[int, zmq.Frame, int]] = field(default_factory=deque)


@dataclass
class _Job:
    """A replay under way: the batches of ``topic`` from ``next_seq`` to ``identity``."""

    identity: bytes
    topic: bytes
    next_seq: int
    stalled_since: float | None = None


@dataclass
class RequestCounts:
    """What one read of requests did: jobs started, requests malformed or ambiguous, requests refused."""

    started: int = 0
    bad: int = 0
    refused: int = 0


class Replays:
    """The replay jobs over ``logs`` (the worker's buffer, by topic), sent on the ROUTER socket each call names."""

    def __init__(self, settings: KVEventsSettings, logs: dict[bytes, TopicLog]) -> None:
        self.settings = settings
        self.logs = logs
        self.jobs: dict[bytes, _Job] = {}
        self.stalled_peers: dict[bytes, float] = {}  # identity -> when its replay was given up

    @property
    def busy(self) -> bool:
        """Whether a job can send now (one whose peer's queue is not full)."""
        return any(job.stalled_since is None for job in self.jobs.values())

    def read_requests(self, router: zmq.Socket) -> RequestCounts:
        """Read up to ``REQUESTS_PER_ROUND`` requests; each starts (or restarts) its peer's job, or gets the end
        marker alone (malformed, ambiguous, or ``REPLAY_JOBS`` under way)."""
        counts = RequestCounts()
        for _ in range(REQUESTS_PER_ROUND):
            try:
                identity = router.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            frames: list[bytes] = []
            extra = 0
            while router.getsockopt(zmq.RCVMORE):
                frame = router.recv()
                if len(frames) < 4:
                    frames.append(frame)
                else:
                    extra += 1
            request = parse_replay_request(frames) if not extra else None
            topic = self.topic_of(request[1]) if request is not None else None
            if request is None or topic is None:
                counts.bad += 1
                send(router, identity, END_SEQ, b"")
                continue
            given_up = self.stalled_peers.get(identity)
            stalled = given_up is not None and time.monotonic() - given_up < STALLED_PEER_S
            if stalled or (identity not in self.jobs and len(self.jobs) >= REPLAY_JOBS):
                counts.refused += 1
                send(router, identity, END_SEQ, b"")
                continue
            counts.started += 1
            previous = self.jobs.get(identity)  # asking again does not restart a stalled job's clock
            self.jobs[identity] = _Job(identity, topic, request[0], previous.stalled_since if previous else None)
        return counts

    def topic_of(self, named: bytes | None) -> bytes | None:
        """The topic a request replays: the one it names; else the only namespace of ``namespaces``, or the only
        topic published so far (b"" when none was); None when that is ambiguous (several topics)."""
        if named is not None:
            return named
        allowed = self.settings.namespaces
        if allowed is not None and len(allowed) == 1:
            return (self.settings.topic + next(iter(allowed))).encode()
        if len(self.logs) <= 1:
            return next(iter(self.logs), b"")
        return None

    def round(self, router: zmq.Socket) -> None:
        """Send up to ``REPLAY_ROUND`` replay messages, shared by the jobs; give up jobs stalled ``REPLAY_STALL_S``."""
        now = time.monotonic()
        share = max(1, REPLAY_ROUND // len(self.jobs))
        for identity in list(self.jobs):
            job = self.jobs[identity]
            if self._advance(router, job, share):
                del self.jobs[identity]
            elif job.stalled_since is not None and now - job.stalled_since > REPLAY_STALL_S:
                del self.jobs[identity]
                self.stalled_peers.pop(identity, None)
                self.stalled_peers[identity] = now
                if len(self.stalled_peers) > STALLED_PEERS:
                    del self.stalled_peers[next(iter(self.stalled_peers))]
        if self.jobs:  # the next round starts with the next job
            first = next(iter(self.jobs))
            self.jobs[first] = self.jobs.pop(first)

    def _advance(self, router: zmq.Socket, job: _Job, quota: int) -> bool:
        """Send up to ``quota`` of ``job``'s batches, then its end marker; True when the job is over."""
        log = self.logs.get(job.topic)
        while quota > 0:
            if log is None or job.next_seq >= log.next_seq:
                result = send(router, job.identity, END_SEQ, b"")
                if result == _AGAIN:
                    job.stalled_since = job.stalled_since or time.monotonic()
                    return False
                return True
            oldest = log.entries[0][0] if log.entries else log.next_seq
            if job.next_seq < oldest:  # older than the buffer: what is left
                job.next_seq = oldest
                continue
            seq, frame, _ = log.entries[job.next_seq - oldest]
            result = send(router, job.identity, seq.to_bytes(8, "big"), frame)
            if result == _GONE:
                return True
            if result == _AGAIN:
                job.stalled_since = job.stalled_since or time.monotonic()
                return False
            job.stalled_since = None
            job.next_seq += 1
            quota -= 1
        return False


def send(router: zmq.Socket, identity: bytes, seq: bytes, payload: bytes | zmq.Frame) -> int:
    """Queue one replay message for ``identity`` without blocking: ``_SENT``, ``_AGAIN`` (its queue is full) or
    ``_GONE`` (no such peer)."""
    try:
        router.send_multipart((identity, b"", seq, payload), flags=zmq.NOBLOCK)
    except zmq.Again:
        return _AGAIN
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EHOSTUNREACH:
            return _GONE
        raise
    return _SENT
