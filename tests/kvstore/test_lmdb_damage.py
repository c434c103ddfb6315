"""A damaged LMDB environment (real files damaged on disk): clear errors at open (never a SIGBUS, an abort or a
raw ``lmdb`` error), a running store that keeps serving from its other tiers and counts the damage, ``kvshelf
repair`` keeping the good blocks byte for byte, and many processes opening one environment while another grows
its map."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO_ROOT, assert_same_block, key_of, make_block
from lmdb_damage import BRANCH as BRANCH_PAGE
from lmdb_damage import (
    DAMAGES,
    MiB,
    block_leaves,
    damage,
    fill,
    keys_under_leaf,
    overwrite,
    page_size,
    pages,
)
from service_helpers import kvshelf_cli

from kvshelf.kvstore import ConfigError, LMDBTier, MemoryTier, TieredStore, encode_block
from kvshelf.kvstore.errors import TierDamagedError

FINGERPRINT = make_block(4).fingerprint

_OPEN = """
import json, sys
from kvshelf.kvstore import LMDBTier
from kvshelf.kvstore.errors import KVShelfError
try:
    tier = LMDBTier(sys.argv[1], initial_map_bytes=1 << 20)
    tier.keys(); tier.usage()
    print(json.dumps({"opened": True}))
except KVShelfError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
"""


def _open_in_subprocess(path: Path) -> subprocess.CompletedProcess:
    # a subprocess: before the fix these crashed the interpreter (SIGBUS, SIGSEGV, an LMDB assertion abort)
    return subprocess.run([sys.executable, "-P", "-c", _OPEN, str(path)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("how", [*DAMAGES, "garbage_meta_pages"])
def test_damaged_environment_is_a_clear_error_at_open(tmp_path, how):
    path = tmp_path / "data" / "lmdb"
    fill(path)
    if how == "garbage_meta_pages":
        size = page_size(path)
        overwrite(path, 0, b"\xa5" * 64)
        overwrite(path, size, b"\x5a" * 64)
    else:
        damage(path, how)
    proc = _open_in_subprocess(path)
    assert proc.returncode == 0, f"the open crashed ({proc.returncode}): {proc.stderr[-2000:]}"
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen.get("error") == "TierDamagedError", seen
    message = seen["message"]
    assert str(path) in message and "is damaged" in message
    assert f"kvshelf repair --data-dir {path.parent}" in message and "kvshelf serve --reset-disk" in message


def test_sound_environment_opens_and_keeps_everything(tmp_path):
    path = tmp_path / "lmdb"
    blocks = fill(path, 120)
    tier = LMDBTier(path, initial_map_bytes=MiB)
    with TieredStore([tier]) as store:
        got = store.get_many(list(blocks), fingerprint=FINGERPRINT, namespace="ns")
        for block, expected in zip(got, blocks.values(), strict=True):
            assert_same_block(block, expected)
        assert not tier.damaged and store.stats()["tiers"][0]["damaged"] is False


def test_size_limit_below_the_minimum_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="minimum of 1048576 bytes"):
        LMDBTier(tmp_path / "lmdb", initial_map_bytes=1024, max_map_bytes=1024)


@pytest.mark.parametrize("how", ["garbage_branch_header", "branch_child", "leaf_overflow_pointer"])
def test_running_store_over_a_tier_damaged_under_it_keeps_serving(tmp_path, how):
    path = tmp_path / "lmdb"
    blocks = fill(path, 300)
    keys = list(blocks)
    disk = LMDBTier(path, initial_map_bytes=MiB)
    memory = MemoryTier(8 * MiB)
    with TieredStore([memory, disk]) as store:
        hot = keys[:10]
        store.get_many(hot, fingerprint=FINGERPRINT, namespace="ns")  # promoted: now in memory too
        assert memory.prefix_run_length(hot) == len(hot)
        size = page_size(path)
        if how == "leaf_overflow_pointer":  # every value pointer of one leaf aims past the file
            leaf = block_leaves(path)[0]
            cold = [k for k in keys_under_leaf(path, leaf) if k not in hot][:5]
            page = (path / "data.mdb").read_bytes()[leaf * size : (leaf + 1) * size]
            for key in cold:
                index = keys_under_leaf(path, leaf).index(key)
                node = int.from_bytes(page[16 + 2 * index : 18 + 2 * index], "little")
                overwrite(path, leaf * size + node + 8 + 16, (10**7).to_bytes(8, "little"))
        else:
            damage(path, how)
            cold = [k for k in keys if k not in hot]  # one batch: some of them lie under the damaged page

        # reads: the memory tier serves what it holds, the damaged tier is a counted miss, never an lmdb error
        got = store.get_many(hot + cold, fingerprint=FINGERPRINT, namespace="ns")
        for key, block in zip(hot, got[: len(hot)], strict=True):
            assert_same_block(block, blocks[key])
        assert got[len(hot) :] == [None] * len(cold)
        assert disk.damaged
        tiers = store.stats()["tiers"]
        assert tiers[1]["name"] == "disk" and tiers[1]["damaged"] is True and tiers[1]["available"] is False
        assert tiers[1]["unavailable"] >= 1
        assert tiers[0]["available"] is True and tiers[0]["damaged"] is False

        # later calls fail fast with the same error, without touching the file
        with pytest.raises(TierDamagedError, match="kvshelf repair"):
            disk.get_many(hot)
        with pytest.raises(TierDamagedError):
            disk.usage()
        assert store.lookup_prefix(hot, namespace="ns") == len(hot)
        # writes go to the memory tier
        new = make_block(list(range(90_000, 90_016)), namespace="ns")
        assert store.put_many([(key_of(new), new)]) == 1
        assert_same_block(store.get_many([key_of(new)], fingerprint=FINGERPRINT, namespace="ns")[0], new)
        assert store.delete([key_of(new)]) == 1
        assert store.stats()["tiers"][1]["unavailable"] >= 3


_LIST_AFTER_DAMAGE = """
import json, sys
sys.path.insert(0, "tests/support")
from pathlib import Path
from lmdb_damage import block_leaves, overwrite, page_size
from kvshelf.kvstore import LMDBTier
from kvshelf.kvstore.errors import KVShelfError
path = Path(sys.argv[1])
tier = LMDBTier(path)
assert len(tier.keys()) == 300
overwrite(path, block_leaves(path)[1] * page_size(path) + 10, b"\\x00\\x00\\xff\\xff")  # a leaf's flags, lower, upper
try:
    print(json.dumps({"keys": len(tier.keys())}))
except KVShelfError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc), "damaged": tier.damaged}))
"""


def test_listing_keys_over_a_leaf_damaged_under_it_is_a_damaged_error(tmp_path):
    # before the fix, LMDB's cursor stepped onto the damaged leaf and the process died of an assertion (abort)
    path = tmp_path / "lmdb"
    fill(path, 300)
    proc = subprocess.run([sys.executable, "-P", "-c", _LIST_AFTER_DAMAGE, str(path)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"crashed ({proc.returncode}): {proc.stderr[-1000:]}"
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["error"] == "TierDamagedError" and seen["damaged"] is True and "kvshelf repair" in seen["message"]


# ------------------------------------------------------------------------------------------------------------
# kvshelf repair
# ------------------------------------------------------------------------------------------------------------


def _readable(path: Path, blocks: dict) -> dict[bytes, bool]:
    """Per key: is the block readable from the (repaired) environment, byte-equal to what was written."""
    tier = LMDBTier(path, initial_map_bytes=MiB)
    try:
        values = tier.get_many(list(blocks))
        return {key: value is not None and value == encode_block(blocks[key], key)
                for key, value in zip(blocks, values, strict=True)}
    finally:
        tier.close()


def test_repair_keeps_the_good_blocks_and_drops_a_damaged_leaf(tmp_path):
    data = tmp_path / "data"
    path = data / "lmdb"
    blocks = fill(path, 300)
    leaf = block_leaves(path)[1]
    lost = set(keys_under_leaf(path, leaf))
    before = (path / "data.mdb").read_bytes()
    damage_at = leaf * page_size(path) + 10
    overwrite(path, damage_at, b"\x00\x00\xff\xff")  # its flags and lower/upper: the leaf is unreadable

    dry = kvshelf_cli("repair", "--data-dir", str(data), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"blocks kept: {300 - len(lost)}" in dry.stdout and "unreadable pages: 1" in dry.stdout
    assert "dry run: nothing changed" in dry.stdout
    assert sorted(p.name for p in data.iterdir()) == ["lmdb"]

    done = kvshelf_cli("repair", "--data-dir", str(data))
    assert done.returncode == 0, done.stderr
    assert f"blocks kept: {300 - len(lost)}" in done.stdout and "unreadable pages: 1" in done.stdout
    aside = [p for p in data.iterdir() if p.name.startswith("lmdb.damaged-")]
    assert len(aside) == 1  # moved aside, never deleted
    damaged_bytes = (aside[0] / "data.mdb").read_bytes()
    assert damaged_bytes[:damage_at] == before[:damage_at]
    readable = _readable(path, blocks)
    assert all(readable[key] for key in blocks if key not in lost)  # byte-equal
    assert not any(readable[key] for key in lost)
    # the repaired environment is sound: repairing it again changes nothing
    again = kvshelf_cli("repair", "--data-dir", str(data))
    assert again.returncode == 0 and "no damage found: nothing changed" in again.stdout
    assert len([p for p in data.iterdir() if p.name.startswith("lmdb.damaged-")]) == 1


def test_repair_drops_a_block_whose_value_is_damaged(tmp_path):
    data = tmp_path / "data"
    path = data / "lmdb"
    blocks = fill(path, 50)
    size = page_size(path)
    first = pages(path, 0x04)[0]
    overwrite(path, first * size + 16 + 200, b"\xde\xad\xbe\xef" * 4)  # inside a value: its checksum fails
    done = kvshelf_cli("repair", "--data-dir", str(data))
    assert done.returncode == 0, done.stderr
    assert "blocks kept: 49" in done.stdout and "blocks damaged (dropped): 1" in done.stdout
    readable = _readable(path, blocks)
    assert sum(readable.values()) == 49


def test_repair_of_a_truncated_file_keeps_what_the_first_half_holds(tmp_path):
    data = tmp_path / "data"
    path = data / "lmdb"
    blocks = fill(path, 300)
    damage(path, "truncated")
    done = kvshelf_cli("repair", "--data-dir", str(data))
    assert done.returncode == 0, done.stderr
    assert "cut short" in done.stdout
    readable = _readable(path, blocks)
    kept = sum(readable.values())
    assert 0 < kept < 300  # every kept one byte-equal (a block is kept only if it verifies against its key)
    assert f"blocks kept: {kept}" in done.stdout


def test_repair_refuses_an_environment_open_elsewhere_and_a_missing_one(tmp_path):
    data = tmp_path / "data"
    fill(data / "lmdb", 5)
    holder = subprocess.Popen([sys.executable, "-P", "-c", "import sys, time; from kvshelf.kvstore import LMDBTier; "
                               "t = LMDBTier(sys.argv[1]); print('open', flush=True); time.sleep(60)",
                               str(data / "lmdb")], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        busy = kvshelf_cli("repair", "--data-dir", str(data))
        assert busy.returncode == 2 and busy.stderr.startswith("error:") and "stop it first" in busy.stderr
    finally:
        holder.kill()
        holder.wait()
    missing = kvshelf_cli("repair", "--data-dir", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "no LMDB environment" in missing.stderr


# ------------------------------------------------------------------------------------------------------------
# many processes opening one environment while another grows its map
# ------------------------------------------------------------------------------------------------------------

_GROWER = """
import sys, time, lmdb
env = lmdb.open(sys.argv[1], max_dbs=4, map_size=1 << 20, sync=False, metasync=False)
db = env.open_db(b"grow")
print("ready", flush=True)
sys.stdin.readline()
end, i = time.monotonic() + float(sys.argv[2]), 0
while time.monotonic() < end:
    # the map just fits what is stored: every commit stores past the map other processes opened a moment ago
    info = env.info()
    env.set_mapsize((info["last_pgno"] + 1) * 4096 + (64 << 10))
    with env.begin(write=True, db=db) as txn:
        txn.put(i.to_bytes(8, "big"), bytes(4000))
    i += 1
print(i, flush=True)
"""

_OPENER = """
import sys, json, time
from kvshelf.kvstore import LMDBTier
print("ready", flush=True)
sys.stdin.readline()
end, opened = time.monotonic() + float(sys.argv[2]), 0
while time.monotonic() < end:
    tier = LMDBTier(sys.argv[1], initial_map_bytes=1 << 20, durable=False)
    tier.get_many([bytes(16)]); tier.usage()
    tier.close()
    opened += 1
print(json.dumps(opened))
"""


@pytest.mark.slow  # 11 interpreters importing kvshelf: ~30 s on 2 busy cores
def test_processes_open_one_environment_while_another_grows_its_map(tmp_path):
    path = tmp_path / "lmdb"
    LMDBTier(path, initial_map_bytes=MiB).close()

    def start(code: str, *args: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-P", "-c", code, str(path), *args], cwd=REPO_ROOT, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        return proc

    grower = start(_GROWER, "25")
    openers = [start(_OPENER, "2") for _ in range(10)]
    try:
        for proc in [grower, *openers]:  # all at once: the openers open while the grower grows
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = [(p.wait(timeout=120), p.stdout.read(), p.stderr.read()) for p in openers]
        assert grower.poll() is None, "the grower stopped before the openers finished"
    finally:
        grower.kill()
        grower.wait()
    failed = [err[-300:] for rc, _, err in results if rc != 0]
    assert not failed, f"{len(failed)} of 10 processes failed to open: {failed[0]}"
    assert all(int(out.strip().splitlines()[-1]) > 0 for _, out, _ in results)


def test_branch_pages_found_by_walking_the_file(tmp_path):
    """The damage helpers find what they claim (one branch page over the blocks leaves)."""
    path = tmp_path / "lmdb"
    fill(path, 300)
    assert len(pages(path, BRANCH_PAGE)) == 1 and len(block_leaves(path)) >= 3
