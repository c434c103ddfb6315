"""``kvshelf bench abuse``: one honest tenant's latency with and without an abusive tenant on the same server.

A real ``kvshelf serve`` runs on loopback over a fresh data directory, with a tokens file of two tenants and
small limits (``--max-block 4MiB``, ``--max-call 32MiB``, ``--quota 16MiB`` by default; the fairness settings
``--tenant-streams`` / ``--idle-timeout`` at the server's defaults unless given). Two phases of ``seconds / 2``:

- ``alone``: the honest tenant's loop through ``RemoteStore``: put 4 real encoded blocks of 256 KiB (one
  PutBlocks call), get them back (one GetBlocks call) and compare the bytes, every ``honest_interval_s``;
  every call has a deadline of ``HONEST_TIMEOUT_S`` and a failed call counts under its status code (its
  latency counts too: the tenant waited for it).
- ``under_abuse``: the same loop while the abusive tenant (``bench/abuser.py``, a process of its own with its
  own token) holds idle and slow streams, sends oversized, bomb, malformed and over-quota puts.

With ``elsewhere`` a control phase runs between the two: ``abuse_elsewhere``, the same abuser process against a
second ``kvshelf serve`` on this machine (its own data directory), while the honest tenant's server sees none of
it. The abuser, the server it abuses and the honest tenant share the machine's cores as they do under abuse, so
the phase measures what sharing the machine costs the honest tenant; ``under_abuse`` past it is the abused
server's own share.

Per phase: the honest tenant's p50/p99 latency, errors by status code of each tenant, ``internal_errors``
(INTERNAL or UNKNOWN statuses anyone saw), ``wrong_blocks`` (gets returning other bytes than were put), the
server's RSS growth (peak during the phase minus the phase's start, sampled every 50 ms from /proc; the server
and its child processes together: the KV events publisher is one). The run checks the issue's figures: honest
p99 under abuse <= 2x alone, RSS growth under abuse <= 2x the per-call limit (plus, with the KV events attacks,
the publisher's own bound: twice ``--kv-events-buffer-bytes`` and its memory guard's margin), no INTERNAL, no
wrong block; and that the server survived, the honest tenant saw no error under abuse, no abuse was accepted and
the abuser never held more than its quota; with the KV events attacks, that an honest subscriber still gets a
live event and a replay its end marker after them.

The run always ends: every call has a deadline, the abuser ends by itself and is killed if late, and the
server is killed at the end (or as soon as its RSS grows by ``SAFETY_RSS_GROWTH``: a decompression bomb must
not take the machine down with it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from kvshelf.bench.abuser import CALL_TIMEOUT_S, CPU_SHARE, DEFAULT_ATTACKS, EXPECTED, MUST_REFUSE
from kvshelf.bench.common import machine_description, save_results
from kvshelf.kvstore import KVBlock, encode_block
from kvshelf.kvstore.errors import ConfigError, KVShelfError, TierUnavailableError
from kvshelf.kvstore.sizes import parse_size

HONEST_TOKEN, ABUSER_TOKEN = "honest-tenant-token", "abusive-tenant-token"
HONEST_NS, ABUSER_NS = "honest", "abuser"
HONEST_TIMEOUT_S = 5.0
HONEST_KEYS, HONEST_BATCH = 32, 4
SAFETY_RSS_GROWTH = 3 << 30
START_TIMEOUT_S = 60.0
INTERNAL_CODES = ("INTERNAL", "UNKNOWN")
CLIENT_DECODE_GROWTH = 128 << 20  # the most a client may grow decoding one hostile block (the Hadamard bomb)


@dataclass(frozen=True)
class AbuseSettings:
    """The server's limits and the abuser's shape (sizes as ``kvshelf serve`` takes them)."""

    seconds: float = 60.0
    max_block: str = "4MiB"
    max_call: str = "32MiB"
    quota: str = "16MiB"
    max_inflight: str | None = None  # None: the server's default
    tenant_streams: int | None = None  # None: the server's default
    idle_timeout: float | None = None  # None: the server's default (10 s)
    strike_burst: int | None = None  # None: the server's default (0: strikes off, every abuse reaches its check)
    disk_codec: str | None = None  # the server's --disk-codec (None: as sent; "int8": the server decodes puts)
    idle_streams: int = 16  # idle PutBlocks streams the abuser keeps open (the server's default worker count)
    slow_streams: int = 2
    honest_interval_s: float = 0.05
    pace_s: float = 0.02  # the abuser's pause between two calls of one thread
    # the abuser's threads to run (to tell which abuse costs what); dupkeys and silentdata (the bulk data path's),
    # slowhttp and labels (HTTP), subscriptions and replay (KV events) only when named
    attacks: tuple[str, ...] = DEFAULT_ATTACKS
    cpu_share: float = CPU_SHARE  # with the ``cpu`` control: the share of one core the abuser process burns
    elsewhere: bool = False  # a control phase: the same abuse against a second server on this machine

    def hold_windows(self) -> dict[str, float]:
        """The abuser's stream-holding windows: long enough for the server's idle timeout to end its streams
        (``hold_s``), with gaps (``gap_s``, a third of it) in which its other abuse meets a free stream cap."""
        from kvshelf.service.serve import ServeConfig

        hold = (self.idle_timeout if self.idle_timeout is not None else ServeConfig().fairness.idle_timeout_s) + 2.0
        return {"hold_s": hold, "gap_s": max(2.0, hold / 3)}

    def serve_args(self, data_dir: Path, tokens: Path) -> list[str]:
        args = ["--listen", "127.0.0.1:0", "--data-dir", str(data_dir), "--memory", "256MiB", "--max-disk", "2GiB",
                "--tokens-file", str(tokens), "--max-block", self.max_block, "--max-call", self.max_call,
                "--quota", self.quota, "--grace", "1"]
        for flag, value in (("--max-inflight", self.max_inflight), ("--tenant-streams", self.tenant_streams),
                            ("--idle-timeout", self.idle_timeout), ("--strike-burst", self.strike_burst),
                            ("--disk-codec", self.disk_codec)):
            if value is not None:
                args += [flag, str(value)]
        from kvshelf.bench.abuse_events import serve_args as events_args  # the events attacks' target: the publisher
        from kvshelf.bench.abuse_http import serve_args  # the HTTP attacks' targets: /metrics and the dashboard

        return args + serve_args(self.attacks) + events_args(self.attacks)


# -- the server -----------------------------------------------------------------------------------------


class ServerProcess:
    """A ``kvshelf serve`` subprocess whose output is always drained (a flood of log lines never blocks it),
    counted (lines, tracebacks) and kept (the last 40 lines)."""

    def __init__(self, args: list[str]) -> None:
        from kvshelf.bench.abuse_events import events_ports_of

        self.events_ports = events_ports_of(args)  # the KV events publisher's and replay ports, when on
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-c", "from kvshelf.cli import main; main()", "serve", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
        )
        self.address: str | None = None
        self.http_ports: list[int] = []  # /metrics and the dashboard, when on
        self.lines = 0
        self.tracebacks = 0
        self.tail: deque[str] = deque(maxlen=40)
        self.killed_for: str | None = None
        self._lock = threading.Lock()
        self._ready = threading.Event()
        threading.Thread(target=self._drain, name="abuse-server-output", daemon=True).start()

    def _drain(self) -> None:
        from kvshelf.bench.abuse_http import http_ports_of

        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._lock:
                self.lines += 1
                self.tracebacks += "Traceback" in line
                self.tail.append(line.rstrip("\n"))
            if self.address is None and "kvshelf serving on " in line:
                self.address = line.split("kvshelf serving on ", 1)[1].split()[0]
                self.http_ports = http_ports_of(line)
                self._ready.set()
        self._ready.set()

    def wait_ready(self) -> str:
        if not self._ready.wait(START_TIMEOUT_S) or self.address is None:
            self.kill()
            raise ConfigError(f"kvshelf serve did not start: {' | '.join(list(self.tail)[-8:])}")
        return self.address

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return self.lines, self.tracebacks

    def alive(self) -> bool:
        return self.proc.poll() is None

    def processes(self) -> list[int]:
        """The server's pid and its descendants' (the KV events publisher is a child process of ``kvshelf serve``)."""
        pids, i = [self.proc.pid], 0
        while i < len(pids):
            for task in Path(f"/proc/{pids[i]}/task").glob("*/children"):
                with contextlib.suppress(OSError, ValueError):
                    pids += [int(p) for p in task.read_text().split()]
            i += 1
        return pids

    def memory(self) -> tuple[int, int] | None:
        """The resident set (VmRSS) and its anonymous part (RssAnon: heap, not mapped files or shared memory) in
        bytes of the server and its child processes together; None once the server has exited."""
        total = [0, 0]
        for n, pid in enumerate(self.processes()):
            try:
                fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                              if ":" in line)
                total[0] += int(fields["VmRSS"].split()[0]) * 1024
                total[1] += int(fields["RssAnon"].split()[0]) * 1024
            except (OSError, ValueError, IndexError, KeyError):
                if n == 0:
                    return None
        return total[0], total[1]

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the server and its child processes running now have used so far; 0.0 once
        the server has exited."""
        total = 0.0
        for n, pid in enumerate(self.processes()):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, ValueError, IndexError):
                if n == 0:
                    return 0.0
        return total

    def kill(self, reason: str | None = None) -> None:
        if self.proc.poll() is None:
            if reason:
                self.killed_for = reason
            self.proc.kill()
            self.proc.wait(timeout=30)


#: RSS must stay flat under sustained abuse once the server has warmed up: growth is measured past the peak of the
#: abuse phase's first this many seconds
SETTLED_AFTER_S = 60.0


def growth_after(series: list[tuple[float, int]], settled_after_s: float = SETTLED_AFTER_S) -> int | None:
    """How far ``series`` (``(seconds, RSS)``) rises after ``settled_after_s`` past its peak before then (0: it never
    goes higher); None when it does not go on past that point (a run too short to say)."""
    first = [rss for t, rss in series if t <= settled_after_s]
    later = [rss for t, rss in series if t > settled_after_s]
    if not first or len(later) < 2:
        return None
    return max(0, max(later) - max(first))


class RssSampler:
    """Samples the server's memory every ``interval_s``; per phase, the start values and the peaks since. Kills
    the server when its RSS grows past ``limit`` bytes above the run's first sample.

    Two measures: VmRSS (the figure) and RssAnon (allocations only: mapped LMDB pages, shared-memory arenas and
    library pages dropped and faulted back in under the machine's memory pressure do not count).
    """

    def __init__(self, server: ServerProcess, *, interval_s: float = 0.05, limit: int = SAFETY_RSS_GROWTH) -> None:
        self.server = server
        self.interval_s = interval_s
        self.limit = limit
        self.first = (server.memory() or (0, 0))[0]
        self.start = self.peak = server.memory() or (0, 0)
        self.began = time.monotonic()
        self.series: list[tuple[float, int]] = []  # (seconds into the phase, RSS): one sample a second
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="abuse-rss", daemon=True)
        self._thread.start()

    def _sample(self) -> tuple[int, int] | None:
        now = self.server.memory()
        if now is not None:
            with self._lock:
                self.peak = (max(self.peak[0], now[0]), max(self.peak[1], now[1]))
                at = time.monotonic() - self.began
                if not self.series or at >= self.series[-1][0] + 1.0:
                    self.series.append((round(at, 1), now[0]))
        return now

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            now = self._sample()
            if now is None:
                return
            if now[0] - self.first > self.limit:
                self.server.kill(f"RSS grew by {now[0] - self.first} bytes (> safety limit {self.limit})")
                return

    def mark(self) -> None:
        """Start a phase: its baselines are the values now."""
        now = self.server.memory() or (0, 0)
        with self._lock:
            self.start = self.peak = now
            self.began, self.series = time.monotonic(), [(0.0, now[0])]

    def phase(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """``((rss, anon) at the start, (rss, anon) peaks)`` of the current phase."""
        self._sample()
        with self._lock:
            return self.start, self.peak

    def phase_series(self) -> list[tuple[float, int]]:
        """``(seconds into the current phase, RSS bytes)``, a sample a second."""
        with self._lock:
            return list(self.series)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# -- the abuser process ----------------------------------------------------------------------------------


class AbuserProcess:
    """``python -m kvshelf.bench.abuser SPEC``: ready line, a go line on stdin, one JSON report line at the end."""

    def __init__(self, spec: dict[str, Any], stderr_path: Path) -> None:
        self._stderr = stderr_path.open("w")
        self.stderr_path = stderr_path
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", "kvshelf.bench.abuser", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name="abuser-output", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def _next(self, timeout: float) -> str | None:
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def wait_ready(self) -> None:
        if self._next(START_TIMEOUT_S) != "ready":
            self.kill()
            raise ConfigError(f"the abuser process did not start: {self.error_tail()}")

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def report(self, timeout: float) -> dict[str, Any] | None:
        line = self._next(timeout)
        try:
            return json.loads(line) if line else None
        except json.JSONDecodeError:
            return None

    def error_tail(self) -> str:
        if not self._stderr.closed:
            self._stderr.flush()
        return " | ".join(self.stderr_path.read_text(errors="replace").strip().splitlines()[-5:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._stderr.close()


# -- the honest tenant -----------------------------------------------------------------------------------


@dataclass
class HonestLog:
    """What the honest tenant saw in one phase."""

    put_ms: list[float] = field(default_factory=list)
    get_ms: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    wrong: int = 0
    misses: int = 0
    verified: int = 0


def honest_values(namespace: str = HONEST_NS) -> list[tuple[bytes, tuple[bytes, bytes]]]:
    """``HONEST_KEYS`` keys, each with two versions of a real encoded fp16 block of 256 KiB."""
    out = []
    for i in range(HONEST_KEYS):
        key = hashlib.blake2b(f"abuse-honest:{i}".encode(), digest_size=16).digest()
        versions = []
        for version in range(2):
            gen = torch.Generator().manual_seed(i * 2 + version)
            shape = (4, 2, 128, 64)
            block = KVBlock(torch.randn(shape, generator=gen).half(), torch.randn(shape, generator=gen).half(),
                            tuple(range(128)), 0, "h" * 32, namespace)
            versions.append(encode_block(block, key))
        out.append((key, (versions[0], versions[1])))
    return out


def error_code(exc: KVShelfError) -> str:
    """The gRPC status code name behind a ``RemoteStore`` error (the type's name when there is none)."""
    code = getattr(exc, "code", None)
    if code is not None and hasattr(code, "name"):
        return str(code.name)
    if isinstance(exc, TierUnavailableError):
        match = re.search(r"unavailable: ([A-Z_]+):", str(exc))
        return match.group(1) if match else "UNAVAILABLE"
    return type(exc).__name__


def _timed(times: list[float], log: HonestLog, fn: Callable[[], Any]) -> tuple[bool, Any]:
    started = time.perf_counter()
    try:
        result = fn()
        ok = True
    except KVShelfError as exc:
        log.errors[error_code(exc)] += 1
        result, ok = None, False
    times.append((time.perf_counter() - started) * 1000)
    return ok, result


def honest_loop(store: Any, values: list[tuple[bytes, tuple[bytes, bytes]]], seconds: float,
                interval_s: float, offset: int = 0) -> tuple[HonestLog, int]:
    """Put a batch, get it back, compare, every ``interval_s`` for ``seconds``; return the log and the next offset.

    Batches cycle through the keys; each cycle writes the other version, so a stale value is a wrong block.
    A get is checked only after its put was acknowledged.
    """
    log = HonestLog()
    end = time.monotonic() + seconds
    n = offset
    while time.monotonic() < end:
        began = time.monotonic()
        picks = [(n * HONEST_BATCH + j) % len(values) for j in range(HONEST_BATCH)]
        version = (n * HONEST_BATCH // len(values)) % 2
        items = [(values[p][0], values[p][1][version]) for p in picks]
        n += 1
        put_ok, _ = _timed(log.put_ms, log, lambda items=items: store.put_encoded_many(items))
        if put_ok:
            get_ok, got = _timed(log.get_ms, log, lambda items=items: store.get_encoded_many([k for k, _ in items]))
            if get_ok:
                for value, (_, want) in zip(got, items, strict=True):
                    log.verified += 1
                    log.misses += value is None
                    log.wrong += value is not None and value != want
        time.sleep(max(0.0, min(began + interval_s, end) - time.monotonic()))
    return log, n


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0.0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)])


# -- the run ---------------------------------------------------------------------------------------------


def _abuse_summary(report: dict[str, Any] | None) -> dict[str, Any]:
    """Per kind: codes, the ones outside what is expected, and accepted abuse (OK where a refusal is due)."""
    if report is None:
        return {"ran": False, "calls": 0, "calls_per_s": 0.0, "kinds": {}, "refused_at_admission": {},
                "unexpected": {}, "accepted": 0, "max_held_bytes": 0}
    kinds: dict[str, dict[str, int]] = report["kinds"]
    unexpected = {kind: {c: n for c, n in codes.items() if c not in EXPECTED.get(kind, frozenset())}
                  for kind, codes in kinds.items()}
    return {**report, "ran": True, "unexpected": {k: v for k, v in unexpected.items() if v},
            "accepted": sum(codes.get("OK", 0) for kind, codes in kinds.items() if kind in MUST_REFUSE)}


def _phase_result(name: str, log: HonestLog, seconds: float, memory: tuple[tuple[int, int], tuple[int, int]],
                  logs: tuple[int, int], server_cpu_s: float,
                  server: ServerProcess, settings: AbuseSettings, abuse: dict[str, Any] | None,
                  series: list[tuple[float, int]] | None = None) -> dict[str, Any]:
    latencies = log.put_ms + log.get_ms
    abuser_codes: Counter[str] = Counter()
    for codes in (abuse or {}).get("kinds", {}).values():
        abuser_codes.update({c: n for c, n in codes.items() if c not in ("OK", "HELD")})
    internal = sum(log.errors.get(c, 0) + abuser_codes.get(c, 0) for c in INTERNAL_CODES)
    result: dict[str, Any] = {
        "phase": name,
        "p50_ms": round(percentile(latencies, 50), 3),
        "p99_ms": round(percentile(latencies, 99), 3),
        "internal_errors": internal,
        "wrong_blocks": log.wrong,
        "server_rss_growth_bytes": max(0, memory[1][0] - memory[0][0]),
        "server_rss_growth_after_first_minute_bytes": growth_after(series or []),
        "server_rss_series_mib": [[t, round(rss / 2**20, 1)] for t, rss in series or []],
        "per_call_limit_bytes": parse_size(settings.max_call, "--max-call"),
        "seconds": round(seconds, 3),
        "honest_calls": len(latencies),
        "put_p50_ms": round(percentile(log.put_ms, 50), 3), "put_p99_ms": round(percentile(log.put_ms, 99), 3),
        "get_p50_ms": round(percentile(log.get_ms, 50), 3), "get_p99_ms": round(percentile(log.get_ms, 99), 3),
        "max_ms": round(max(latencies, default=0.0), 3),
        "honest_errors": dict(sorted(log.errors.items())),
        "abuser_errors": dict(sorted(abuser_codes.items())),
        "honest_blocks_verified": log.verified,
        "honest_misses": log.misses,
        "server_rss_start_bytes": memory[0][0],
        "server_rss_peak_bytes": memory[1][0],
        "server_anon_growth_bytes": max(0, memory[1][1] - memory[0][1]),
        "server_address": server.address,
        "server_alive": server.alive(),
        "server_killed_for": server.killed_for,
        "server_cpu_s": round(server_cpu_s, 3),
        "server_log_lines": logs[0],
        "server_tracebacks": logs[1],
        "max_block_bytes": parse_size(settings.max_block, "--max-block"),
        "events_publisher_bound_bytes": _events_bound(settings),
        "quota_bytes": parse_size(settings.quota, "--quota"),
        "settings": asdict(settings),
        "machine": machine_description(),
    }
    if abuse is not None:
        result["abuser"] = abuse
    return result


def _run_phase(name: str, seconds: float, store: Any, values: list[tuple[bytes, tuple[bytes, bytes]]],
               server: ServerProcess, sampler: RssSampler, settings: AbuseSettings, offset: int,
               abuser: AbuserProcess | None, abuser_error: str | None = None) -> tuple[dict[str, Any], int]:
    """One phase of the honest loop, with ``abuser`` (if any) let go at its start; ``abuser_error``: why the
    phase's abuser did not start (reported as its summary)."""
    sampler.mark()
    lines0, tracebacks0 = server.counts()
    cpu0 = server.cpu_s()
    started = time.monotonic()
    if abuser is not None:
        abuser.go()
    log, offset = honest_loop(store, values, seconds, settings.honest_interval_s, offset)
    elapsed = time.monotonic() - started
    abuse = None if abuser_error is None else {**_abuse_summary(None), "error": abuser_error}
    if abuser is not None:
        abuse = _abuse_summary(abuser.report(timeout=max(0.0, seconds - elapsed) + CALL_TIMEOUT_S + 5))
        if not abuse["ran"]:
            abuse["error"] = abuser.error_tail()
    memory = sampler.phase()
    lines1, tracebacks1 = server.counts()
    return _phase_result(name, log, elapsed, memory, (lines1 - lines0, tracebacks1 - tracebacks0),
                         max(0.0, server.cpu_s() - cpu0), server, settings, abuse, sampler.phase_series()), offset


def _start_abuser(spec: dict[str, Any], stderr_path: Path) -> tuple[AbuserProcess | None, str | None]:
    """The abuser process, ready for its go line; or None and why it did not start (e.g. the server died in an
    earlier phase: measured and reported as such)."""
    abuser = AbuserProcess(spec, stderr_path)
    try:
        abuser.wait_ready()
    except ConfigError as exc:
        return None, str(exc)
    return abuser, None


def _elsewhere_phase(seconds: float, store: Any, values: list[tuple[bytes, tuple[bytes, bytes]]],
                     server: ServerProcess, sampler: RssSampler, settings: AbuseSettings, offset: int,
                     spec: dict[str, Any], tmp: Path, tokens: Path) -> tuple[dict[str, Any], int]:
    """The control phase: the abuser of ``spec`` attacks a second server (same settings, its own data directory)
    while the honest tenant keeps using ``server``; both extra processes are gone when it returns."""
    other = ServerProcess(settings.serve_args(tmp / "data-elsewhere", tokens))
    abuser: AbuserProcess | None = None
    try:
        target = other.wait_ready()
        abuser, not_started = _start_abuser({**spec, "address": target, "http_ports": other.http_ports,
                                                  "server_pid": other.proc.pid, "events_ports": other.events_ports},
                                                 tmp / "abuser-elsewhere.err")
        result, offset = _run_phase("abuse_elsewhere", seconds, store, values, server, sampler, settings, offset,
                                    abuser, not_started)
        result["abuser"]["server"] = {"address": target, "alive": other.alive(), "cpu_s": round(other.cpu_s(), 3)}
        return result, offset
    finally:
        if abuser is not None:
            abuser.kill()
        other.kill()


def _events_bound(settings: AbuseSettings) -> int:
    """What the KV events publisher process may hold past its start when the events attacks run (0 otherwise): its
    replay buffer and as much again pinned for slow peers (``--kv-events-buffer-bytes`` each), and the margin its
    memory guard allows before it drops connections (``GUARD_MARGIN_BYTES``)."""
    from kvshelf.bench.abuse_events import EVENT_ATTACKS, EVENTS_BUFFER
    from kvshelf.kvstore.vllm_events_worker import GUARD_MARGIN_BYTES

    if not set(settings.attacks) & set(EVENT_ATTACKS):
        return 0
    return 2 * parse_size(EVENTS_BUFFER, "--kv-events-buffer-bytes") + GUARD_MARGIN_BYTES


def _events_listeners(store: Any, server: ServerProcess) -> dict[str, Any]:
    """After the abuse: whether a router of the honest tenant still gets a live event of its put and a replay's end
    marker (``bench.abuse_events.listeners_alive``); each probe put is a block of a key of its own."""
    from kvshelf.bench.abuse_events import listeners_alive

    serial = iter(range(1 << 30))

    def put_one() -> None:
        key = hashlib.blake2b(f"abuse-honest:probe:{next(serial)}".encode(), digest_size=16).digest()
        keys = torch.zeros((1, 1, 4, 8), dtype=torch.float16)
        block = KVBlock(keys, keys.clone(), (1, 2, 3, 4), 0, "h" * 32, HONEST_NS)
        with contextlib.suppress(KVShelfError):
            store.put_encoded_many([(key, encode_block(block, key))])

    return listeners_alive(put_one, server.events_ports, HONEST_NS)


def _times(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base > 0 else "-"


def _phase(results: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return next((r for r in results if r["phase"] == name), None)


def checks(results: list[dict[str, Any]]) -> list[tuple[str, bool, str]]:
    """The issue's figures (and the run's sanity): ``(what, passed, detail)``; the control phase, when run, is
    reported beside them (it is a measurement of the machine, not a check)."""
    alone, under = results[0], results[-1]
    abuse = under.get("abuser", {})
    limit = under["per_call_limit_bytes"]
    events_bound = under.get("events_publisher_bound_bytes", 0)
    growth = under["server_rss_growth_bytes"]
    internal = sum(r["internal_errors"] for r in results)
    wrong = sum(r["wrong_blocks"] for r in results)
    held, quota = abuse.get("max_held_bytes", 0), under["quota_bytes"]
    decode_growth = abuse.get("client_decode_growth", 0)
    settled = under.get("server_rss_growth_after_first_minute_bytes")
    after_first_minute = [] if settled is None else [
        (f"server RSS growth after the first {SETTLED_AFTER_S:.0f} s of abuse <= 2 x per-call limit",
         settled <= 2 * limit, f"{settled / 2**20:.1f} MiB vs 2 x {limit / 2**20:.0f} MiB")]
    listeners = under.get("events_listeners")
    events = [] if listeners is None else [
        ("the KV events listeners alive after the abuse (a live event, a replay's end marker)",
         listeners["live_event_s"] is not None and listeners["replay"] in ("END", "END_ALONE"),
         f"live event after {listeners['live_event_s']} s; replay: {listeners['replay']}, "
         f"{listeners.get('replay_batches', 0)} batches")]
    control = _phase(results, "abuse_elsewhere")
    machine = ("" if control is None else
               f"; with the abuse on a second server of this machine {control['p99_ms']:.1f} ms "
               f"({_times(control['p99_ms'], alone['p99_ms'])} alone)")
    return [
        *after_first_minute,
        ("honest p99 under abuse <= 2 x alone", under["p99_ms"] <= 2 * alone["p99_ms"] and under["honest_calls"] > 0,
         f"{under['p99_ms']:.1f} ms vs 2 x {alone['p99_ms']:.1f} ms ({_times(under['p99_ms'], alone['p99_ms'])})"
         f"{machine}"),
        ("server RSS growth under abuse <= 2 x per-call limit" + (" + the KV events publisher's bound" if events_bound
                                                                  else ""),
         growth <= 2 * limit + events_bound,
         f"{growth / 2**20:.1f} MiB vs 2 x {limit / 2**20:.0f} MiB"
         + (f" + {events_bound / 2**20:.0f} MiB" if events_bound else "")),
        ("0 INTERNAL statuses", internal == 0, str(internal)),
        ("0 wrong blocks", wrong == 0, str(wrong)),
        ("honest calls under abuse all succeeded", not under["honest_errors"], str(under["honest_errors"] or "")),
        ("server alive at the end", under["server_alive"], under["server_killed_for"] or ""),
        ("the abuser ran and no abuse was accepted", abuse.get("ran", False) and abuse.get("accepted", 0) == 0,
         f"{abuse.get('accepted', 0)} accepted" if abuse.get("ran") else abuse.get("error", "did not run")),
        ("the abuser never held more than its quota", held <= quota, f"{held / 2**20:.1f} MiB of {quota / 2**20:.0f}"),
        ("a client decoding a hostile block grows <= 128 MiB", decode_growth <= CLIENT_DECODE_GROWTH,
         f"{decode_growth / 2**20:.1f} MiB"),
        *events,
    ]


def _print(results: list[dict[str, Any]], verdicts: list[tuple[str, bool, str]], console: Console) -> None:
    for table in results_tables({"results": results}):
        console.print(table)
    for what, passed, detail in verdicts:
        mark = "[green]PASS[/green]" if passed else "[red]FAIL[/red]"
        console.print(f"  {mark} {what}: {detail}", highlight=False)


def results_tables(payload: dict[str, Any]) -> list[Table]:
    """The tables of a saved payload (``{"results": [alone, (abuse_elsewhere,) under_abuse]}``): the phases side
    by side, then the abuser's calls by kind under abuse when it ran (``run``'s printout; docs/benchmarks.md
    renders them)."""
    results = payload["results"]
    table = Table(title=f"abuse: honest tenant alone vs under abuse ({results[0]['machine']})")
    table.add_column("")
    for r in results:
        table.add_column(r["phase"], justify="right")
    rows: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
        ("seconds", lambda r: f"{r['seconds']:.1f}"),
        ("honest calls", lambda r: r["honest_calls"]),
        ("honest p50 / p99 ms", lambda r: f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f}"),
        ("honest p99 / alone's", lambda r: _times(r["p99_ms"], results[0]["p99_ms"])),
        ("  put p50 / p99 ms", lambda r: f"{r['put_p50_ms']:.1f} / {r['put_p99_ms']:.1f}"),
        ("  get p50 / p99 ms", lambda r: f"{r['get_p50_ms']:.1f} / {r['get_p99_ms']:.1f}"),
        ("honest max ms", lambda r: f"{r['max_ms']:.1f}"),
        ("honest errors", lambda r: _codes(r["honest_errors"])),
        ("honest blocks verified / misses", lambda r: f"{r['honest_blocks_verified']} / {r['honest_misses']}"),
        ("wrong blocks", lambda r: r["wrong_blocks"]),
        ("abuser calls (calls/s)", lambda r: (f"{r['abuser']['calls']} ({r['abuser']['calls_per_s']:.0f}/s)"
                                              if "abuser" in r else "-")),
        ("CPU s: server / abuser", lambda r: f"{r['server_cpu_s']:.1f} / "
                                             f"{r['abuser']['cpu_s']:.1f}" if r.get("abuser", {}).get("ran")
                                             else f"{r['server_cpu_s']:.1f} / -"),
        ("abuser errors", lambda r: _codes(r["abuser_errors"])),
        ("abuser decode growth MiB", lambda r: f"{r['abuser'].get('client_decode_growth', 0) / 2**20:.1f}"
                                               if r.get("abuser", {}).get("ran") else "-"),
        ("INTERNAL / UNKNOWN", lambda r: r["internal_errors"]),
        ("server RSS start MiB", lambda r: f"{r['server_rss_start_bytes'] / 2**20:.0f}"),
        ("server RSS growth MiB", lambda r: f"{r['server_rss_growth_bytes'] / 2**20:.1f}"),
        ("  of it anonymous (RssAnon) MiB", lambda r: f"{r['server_anon_growth_bytes'] / 2**20:.1f}"),
        (f"  past the first {SETTLED_AFTER_S:.0f} s' peak MiB",
         lambda r: "-" if r.get("server_rss_growth_after_first_minute_bytes") is None
         else f"{r['server_rss_growth_after_first_minute_bytes'] / 2**20:.1f}"),
        ("server log lines / tracebacks", lambda r: f"{r['server_log_lines']} / {r['server_tracebacks']}"),
        ("server alive", lambda r: "yes" if r["server_alive"] else f"NO {r['server_killed_for'] or ''}"),
        ("KV events after: live event s / replay", lambda r: "-" if "events_listeners" not in r else
         f"{r['events_listeners']['live_event_s']} / {r['events_listeners']['replay']} "
         f"({r['events_listeners'].get('replay_batches', 0)} batches)"),
    ]
    if all(r.get("server_rss_growth_after_first_minute_bytes") is None for r in results):  # a run too short for it
        rows = [row for row in rows if "past the first" not in row[0]]
    if not any("events_listeners" in r for r in results):
        rows = [row for row in rows if not row[0].startswith("KV events")]
    for label, cell in rows:
        table.add_row(label, *(str(cell(r)) for r in results))
    tables = [table]
    abuse = results[-1].get("abuser", {}) if len(results) > 1 else {}
    if abuse.get("kinds"):
        kinds = Table(title=f"abuse calls by kind ({abuse['calls']} calls in {abuse['seconds']:.1f} s, "
                            f"{abuse['calls_per_s']:.0f}/s; HELD: open until the abuser let go)")
        kinds.add_column("kind")
        kinds.add_column("status codes")
        kinds.add_column("at admission", justify="right")
        kinds.add_column("unexpected")
        for kind, codes in abuse["kinds"].items():
            odd = abuse["unexpected"].get(kind, {})
            kinds.add_row(kind, _codes(codes), str(abuse["refused_at_admission"].get(kind, "")),
                          f"[red]{_codes(odd)}[/red]" if odd else "")
        tables.append(kinds)
    return tables


def _codes(codes: dict[str, int]) -> str:
    return ", ".join(f"{c} {n}" for c, n in codes.items()) or "-"


def run(*, json_path: str | None, settings: AbuseSettings | None = None,
        console: Console | None = None) -> dict[str, Any]:
    """Run both phases; print the tables and the figures; write ``{"results": [...]}`` to ``json_path``.

    Returns ``{"results": [...], "checks": [...], "ok": bool}``.
    """
    from kvshelf.service.client import RemoteStore

    settings = settings or AbuseSettings()
    console = console or Console()
    for name, value in (("--max-block", settings.max_block), ("--max-call", settings.max_call),
                        ("--quota", settings.quota)):
        parse_size(value, name)
    half = settings.seconds / 2
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvshelf-abuse-") as tmp:
        tokens = Path(tmp) / "tokens.toml"
        tokens.write_text(f'[tokens]\n"{HONEST_TOKEN}" = "{HONEST_NS}"\n"{ABUSER_TOKEN}" = "{ABUSER_NS}"\n')
        server = ServerProcess(settings.serve_args(Path(tmp) / "data", tokens))
        sampler: RssSampler | None = None
        store: RemoteStore | None = None
        abuser: AbuserProcess | None = None
        try:
            address = server.wait_ready()
            values = honest_values()
            store = RemoteStore(address, token=HONEST_TOKEN, namespace=HONEST_NS, timeout_s=HONEST_TIMEOUT_S,
                                connect_timeout_s=10)
            honest_loop(store, values, 1.0, settings.honest_interval_s)  # warm-up: connections, arenas, tiers
            sampler = RssSampler(server)
            console.print(f"phase alone: {half:g} s of the honest tenant on {address}")
            alone, offset = _run_phase("alone", half, store, values, server, sampler, settings, 0, None)
            results.append(alone)
            spec = {"address": address, "token": ABUSER_TOKEN, "namespace": ABUSER_NS, "seconds": half,
                    "max_block": alone["max_block_bytes"], "max_call": alone["per_call_limit_bytes"],
                    "quota": alone["quota_bytes"], "idle_streams": settings.idle_streams,
                    "slow_streams": settings.slow_streams, "pace_s": settings.pace_s, "attacks": list(settings.attacks),
                    "cpu_share": settings.cpu_share, "http_ports": server.http_ports, "server_pid": server.proc.pid,
                    "events_ports": server.events_ports, **settings.hold_windows()}
            if settings.elsewhere:
                console.print(f"phase abuse_elsewhere: {half:g} s of the honest tenant while the abuser attacks "
                              "a second server on this machine")
                control, offset = _elsewhere_phase(half, store, values, server, sampler, settings, offset, spec,
                                                   Path(tmp), tokens)
                results.append(control)
            abuser, not_started = _start_abuser(spec, Path(tmp) / "abuser.err")
            console.print(f"phase under_abuse: {half:g} s of the honest tenant while the abuser attacks")
            under, _ = _run_phase("under_abuse", half, store, values, server, sampler, settings, offset, abuser,
                                  not_started)
            if server.events_ports:  # after the attack: the abuser's process (and every peer it held) gone first
                if abuser is not None:
                    abuser.kill()
                under["events_listeners"] = _events_listeners(store, server)
            results.append(under)
        finally:
            if abuser is not None:
                abuser.kill()
            if store is not None:
                store.close()
            if sampler is not None:
                sampler.stop()
            server.kill()
    verdicts = checks(results)
    _print(results, verdicts, console)
    ok = all(passed for _, passed, _ in verdicts)
    console.print("[green]OK[/green]: the honest tenant kept its latency" if ok else "[red]FAILED[/red]: see above")
    save_results(json_path, {"results": results}, console)
    return {"results": results, "checks": [{"what": w, "passed": p, "detail": d} for w, p, d in verdicts], "ok": ok}
