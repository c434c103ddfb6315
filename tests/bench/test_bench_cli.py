"""`kvshelf bench ...` options checked before any model loads: one readable line and exit code 2."""

from __future__ import annotations

import pytest
from service_helpers import kvshelf_cli


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--codec", "nope"], "nope"),
        (["--codec", "xquant", "--codec-params", '{"stepp": 1}'], "stepp"),
        (["--codec", "int4", "--codec-params", "{not json"], "--codec-params must be a JSON object"),
        (["--codec", "int4", "--codec-params", "[1, 2]"], "--codec-params must be a JSON object"),
        (["--codec", "int4", "--codec-params", '{"group_size": 0}'], "group_size"),
        (["--lengths", "100"], "block size"),
    ],
)
def test_bench_ttft_bad_options(args, message):
    result = kvshelf_cli("bench", "ttft", *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2 and "Traceback" not in result.stderr


@pytest.mark.parametrize("methods", ["bogus", "snapkv,nope", ","])
def test_bench_pruning_unknown_methods(methods):
    result = kvshelf_cli("bench", "pruning", "--methods", methods)
    assert result.returncode == 2, result.stderr
    assert "--methods: unknown" in result.stderr and "snapkv" in result.stderr
    assert "Traceback" not in result.stderr


def test_bench_ttft_rounds_must_be_positive():
    result = kvshelf_cli("bench", "ttft", "--rounds", "0")
    assert result.returncode == 2, result.stderr
    assert "--rounds" in result.stderr and "Traceback" not in result.stderr


def test_bench_store_bad_durability_and_backend():
    result = kvshelf_cli("bench", "store", "--durability", "sometimes")
    assert result.returncode == 2, result.stderr
    assert "--durability must be one of fsync, interval" in result.stderr and "Traceback" not in result.stderr
    result = kvshelf_cli("bench", "store", "--backends", "grpc-wire,nope")
    assert result.returncode == 2 and "unknown backend(s) ['nope']" in result.stderr


def test_bench_store_backends_take_the_servers_durability():
    from kvshelf.bench.store import BACKENDS, DURABLE_BACKENDS, chosen_backends

    chosen = chosen_backends(["grpc-wire", "grpc-wire-fsync", "redis"], "fsync")
    assert chosen["grpc-wire"].keywords == {"durability": "fsync"}  # type: ignore[attr-defined]
    assert chosen["grpc-wire-fsync"] is BACKENDS["grpc-wire-fsync"] and chosen["redis"] is BACKENDS["redis"]
    assert set(BACKENDS) >= DURABLE_BACKENDS
