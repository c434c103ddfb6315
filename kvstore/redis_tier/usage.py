"""The Redis tier's usage accounting: counters that stay right while Redis evicts values on its own.

kvshelf never evicts from Redis: Redis's ``maxmemory-policy`` does, without telling anyone what it removed and how
large it was. So the tier keeps, next to its two counters, a *registry* of the values it counted, in one Redis hash
(``{<prefix>#usage}``, one Cluster slot):

* ``v`` = ``2`` (the format), ``blocks`` and ``bytes`` (the counters), and ``stale`` while it awaits a recount;
* one field per value, ``e:<hex key>:<hex generation>`` = ``<state>:<size>:<chunks>:<time>``: state ``+`` (counted
  in), ``-`` (counted out before it was counted in: a delete overtook the put's accounting), ``x`` (found evicted
  by Redis and counted out; the writer's own ``-`` may still come); ``time`` is Redis's clock (``TIME``).

Every change goes through one Lua script (``USAGE_SCRIPT``) that updates the entries and the counters together,
atomically, so the counters always equal the sum over the entries (``+`` counts in, ``-`` counts out, ``x``
nothing). The operations commute: a put's ``+`` and a racing delete's ``-`` of the same generation give nothing
in either order, and an eviction found by several processes at once is counted out once (only a ``+`` entry can
become ``x``). Entries ``-`` and ``x`` are leftovers of a transition in flight; one older than ``SETTLE_S``
(its writer died) is settled by the next reconciliation.

Finding Redis's evictions (``RedisTier.reconcile``): walk the registry (``HSCAN``, in bounded steps) and ask
whether each counted value is still whole -- one ``EXISTS`` of its manifest and chunks (``EXISTS`` does not touch
Redis's LRU/LFU clocks, so reconciling does not change what Redis evicts next). A value that is not is counted
out (``x``), its remnants removed, and reported to the store as an eviction. It runs when Redis's own
``evicted_keys`` (``INFO stats``, summed over primaries) has grown since the last pass: on every ``usage()`` and
at most every ``reconcile_interval_s`` after a put; at most ``RECONCILE_STEP`` entries per call.

The hash is a Redis key like any other: ``allkeys-*`` policies may evict it too (under ``allkeys-lru`` only when
every key Redis samples is younger than its one-second LRU clock, i.e. the whole cache turns over within a
second; practically never under ``allkeys-lfu``, where its frequency counter, bumped by every write, is far above a
value's). Its loss (no ``v`` field), damage (wrong type, counters that are not integers) or an older format is
seen by the next write or ``usage()``: a write creates an empty one marked ``stale`` (and counts its own values
in), the next ``usage()`` recounts -- every whole value found by ``SCAN`` is counted in unless known, then a whole
reconciliation pass -- and clears the mark. While ``stale``, a removal of a value the registry does not know counts
nothing (it was counted in the lost one). Scripts refuse to touch a hash that is missing or damaged (they return
``LOST``), so nothing half-counted is ever written into it. What a lost registry costs: values Redis evicted
while it was gone are not reported one by one as evictions (the counters are right again after the recount).

The scripts carry ``#!lua flags=allow-oom`` (Redis 7+): under ``noeviction`` a full Redis refuses writes, but
the accounting of a delete or of a value Redis did take must not be refused with them.

Costs (measured on the 2-core dev machine, standalone Redis 7.0, 24-byte keys): ~147 bytes of registry per value;
one more round trip per ``put_many``/``delete`` call (1 KiB values: 185 -> 226 us a single-value put, 26.9 -> 29.4
us a value in puts of 64); a reconciliation ~19 us per entry (23,000 entries: 0.44 s); a recount ~25 us per
value (0.57 s) plus the ``SCAN`` of the database. Limits: ``EXISTS`` cannot tell generations apart, so an inline
value overwritten by a writer that died between its ``SET`` and its accounting stays counted at its old size
until a ``recount()`` (the recount after a lost registry checks generations, with a ``GETRANGE`` that touches
Redis's clocks: it is rare). Chunks whose manifest Redis evicted before anyone counted the value (a lost
registry) are left for Redis to evict in turn (nothing reads them). The per-process namespace figures of a
server learn of an eviction only through the store's ``evicted`` event, which carries no namespace name: the
store counts such evictions under namespace ``unknown``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the registry's format (the ``v`` field); a hash without it is rebuilt
FORMAT = "2"
#: an entry left ``-`` or ``x`` this long (seconds of Redis's clock) is settled: its transition will never come
SETTLE_S = 300
#: a put checks for Redis's evictions at most this often (seconds; ``usage()`` always checks)
RECONCILE_INTERVAL_S = 5.0
#: registry entries one reconciliation call looks at (a larger registry takes several calls)
RECONCILE_STEP = 20_000
#: entries per HSCAN reply and per EXISTS pipeline
SCAN_BATCH = 512
#: what a script returns when the hash is missing, of another format, or damaged: nothing was changed
LOST = -1

#: the registry and counters updates (see the module docstring). ARGV: groups of four (op, field, size, chunks);
#: ops ``+`` (a value stored), ``s`` (seeded by a recount: counted in only if unknown), ``-`` (a value removed),
#: ``x`` (a value found gone: counted out only if counted in), ``settle`` (size: the age in seconds past which a
#: ``-`` or ``x`` entry goes). Returns one 0/1 per op (1: it changed something), or LOST.
USAGE_SCRIPT = """#!lua flags=allow-oom
local h = KEYS[1]
if redis.call('TYPE', h)['ok'] ~= 'hash' then return -1 end
local head = redis.call('HMGET', h, 'v', 'blocks', 'bytes', 'stale')
local function int(s) return s and #s <= 18 and string.match(s, '^%-?%d+$') ~= nil end
if head[1] ~= '2' or not int(head[2]) or not int(head[3]) then return -1 end
local stale = head[4]
local now = redis.call('TIME')[1]
local db, dbytes = 0, 0
local out = {}
for i = 1, #ARGV, 4 do
  local op, f, size, chunks = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local cur = redis.call('HGET', h, f)
  local state, csize, ctime
  if cur then
    local s, n, c, t = string.match(cur, '^([%+%-x]):(%d+):(%d+):(%d+)$')
    if s then
      state, csize, ctime = s, tonumber(n), tonumber(t)
    else
      redis.call('HDEL', h, f)  -- not an entry of ours: it counted nothing
      cur = nil
    end
  end
  local r = 0
  if op == '+' or op == 's' then
    if not cur then
      redis.call('HSET', h, f, '+:' .. size .. ':' .. chunks .. ':' .. now)
      db, dbytes, r = db + 1, dbytes + tonumber(size), 1
    elseif op == '+' and state == '-' then
      redis.call('HDEL', h, f)
      db, dbytes, r = db + 1, dbytes + csize, 1
    end
  elseif op == '-' then
    if not cur and stale then
      -- a registry rebuilt since the value was counted in the one before: nothing to count out here
    elseif not cur then
      redis.call('HSET', h, f, '-:' .. size .. ':' .. chunks .. ':' .. now)
      db, dbytes, r = db - 1, dbytes - tonumber(size), 1
    elseif state == '+' then
      redis.call('HDEL', h, f)
      db, dbytes, r = db - 1, dbytes - csize, 1
    elseif state == 'x' then
      redis.call('HDEL', h, f)
    end
  elseif op == 'x' then
    if state == '+' then
      redis.call('HSET', h, f, 'x:' .. csize .. ':0:' .. now)
      db, dbytes, r = db - 1, dbytes - csize, 1
    end
  elseif op == 'settle' then
    if (state == '-' or state == 'x') and ctime <= tonumber(now) - tonumber(size) then
      redis.call('HDEL', h, f)
      r = 1
      if state == '-' then db, dbytes = db + 1, dbytes + csize end
    end
  end
  out[#out + 1] = r
end
if db ~= 0 then redis.call('HINCRBY', h, 'blocks', db) end
if dbytes ~= 0 then redis.call('HINCRBY', h, 'bytes', dbytes) end
return out
"""

#: (re)creates an empty registry unless a sound one exists (ARGV[1] = '1': always, for a recount from scratch).
#: One created otherwise is marked ``stale`` (values Redis holds may be missing from it: the next ``usage()``
#: recounts, and meanwhile a removal of a value it does not know counts nothing). Returns 0: a sound one was
#: there; 1: created where there was none; 2: replaced a damaged or older one.
INIT_SCRIPT = """#!lua flags=allow-oom
local h = KEYS[1]
local t = redis.call('TYPE', h)['ok']
if ARGV[1] ~= '1' and t == 'hash' then
  local head = redis.call('HMGET', h, 'v', 'blocks', 'bytes')
  local function int(s) return s and #s <= 18 and string.match(s, '^%-?%d+$') ~= nil end
  if head[1] == '2' and int(head[2]) and int(head[3]) then return 0 end
end
redis.call('DEL', h)
redis.call('HSET', h, 'v', '2', 'blocks', '0', 'bytes', '0')
if ARGV[1] ~= '1' then redis.call('HSET', h, 'stale', '1') end
if t == 'none' then return 1 end
return 2
"""


def unflagged(script: str) -> str:
    """``script`` without its ``#!lua`` line, for a Redis older than 7 (which has no script flags)."""
    return script.split("\n", 1)[1] if script.startswith("#!") else script


def entry_field(key: bytes, generation: bytes) -> str:
    return f"e:{key.hex()}:{generation.hex()}"


@dataclass(frozen=True)
class Entry:
    """One registry entry: a value (key, generation) and what it was counted as."""

    field: str
    key: bytes
    generation: bytes
    state: str
    size: int
    chunks: int
    time: int

    @classmethod
    def parse(cls, field: bytes | str, value: bytes | str) -> Entry | None:
        """The entry, or ``None`` when the field is not a well-formed entry (the counters or anything else)."""
        field = field.decode("ascii", "replace") if isinstance(field, bytes) else field
        value = value.decode("ascii", "replace") if isinstance(value, bytes) else value
        parts, numbers = field.split(":"), value.split(":")
        if len(parts) != 3 or parts[0] != "e" or len(numbers) != 4 or numbers[0] not in ("+", "-", "x"):
            return None
        try:
            key, generation = bytes.fromhex(parts[1]), bytes.fromhex(parts[2])
            size, chunks, time = int(numbers[1]), int(numbers[2]), int(numbers[3])
        except ValueError:
            return None
        if len(generation) != 8 or min(size, chunks, time) < 0:
            return None
        return cls(field, key, generation, numbers[0], size, chunks, time)
