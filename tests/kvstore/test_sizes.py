"""Size settings: ``parse_size`` rejects what is not a sane byte count, the tiers and the embedded store name the
bad setting, and every size flag of ``kvshelf serve`` ends in one ``error:`` line (no traceback, no server)."""

from __future__ import annotations

import math
import threading

import pytest
from service_helpers import kvshelf_cli

from kvshelf.kvstore import ConfigError, MemoryTier, open_embedded_store, parse_size
from kvshelf.kvstore.sizes import MAX_SIZE_BYTES

GiB = 1 << 30


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1.5GiB", 3 * GiB // 2),  # a fraction with a unit: fine
        ("1.1GiB", math.floor(1.1 * GiB)),  # ... rounded down to whole bytes
        ("0", 0),
        (0, 0),
        (4096.0, 4096),  # a float holding a whole number of bytes
        ("1EiB", 1 << 60),
        (MAX_SIZE_BYTES, MAX_SIZE_BYTES),
    ],
)
def test_parse_size_accepts(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (True, "not a size"),
        (False, "not a size"),
        (1.5, "whole number of bytes"),
        ("1.5", "whole number of bytes"),
        ("1.5b", "whole number of bytes"),
        (float("nan"), "whole number of bytes"),
        (float("inf"), "whole number of bytes"),
        (-1, "negative"),
        ("-1", "negative"),
        ("-2GiB", "negative"),
        ("99999999999999999999999TiB", "too large"),
        ("9" * 5000, "too large"),  # past Python's int-from-string digit limit: still our error
        (MAX_SIZE_BYTES + 1, "too large"),
        ("2EiB", "too large"),
        ("0.0001KiB", "less than one byte"),
        (None, "not a size"),
        ([1], "not a size"),
    ],
)
def test_parse_size_rejects(value, why):
    with pytest.raises(ConfigError, match=why):
        parse_size(value)


def test_parse_size_names_the_setting():
    with pytest.raises(ConfigError, match="^memory: "):
        parse_size("1.5", "memory")


@pytest.mark.parametrize("capacity", [True, 1.5, 0, -5, "1GiB"])
def test_memory_tier_rejects_non_sizes(capacity):
    with pytest.raises(ConfigError, match="memory tier capacity"):
        MemoryTier(capacity)


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"memory_bytes": True}, "memory_bytes"),
        ({"memory_bytes": 1.5}, "memory_bytes"),
        ({"memory_bytes": "99999999999999999999999TiB"}, "memory_bytes"),
        ({"max_disk_bytes": "1KiB"}, "max_disk_bytes"),  # was a raw lmdb.MapFullError
        ({"max_disk_bytes": True}, "max_disk_bytes"),
        ({"max_disk_bytes": 0}, "max_disk_bytes"),
    ],
)
def test_open_embedded_store_names_the_bad_size(data_dir, kwargs, setting):
    with pytest.raises(ConfigError, match=f"^{setting}: "):
        open_embedded_store(data_dir, **kwargs)
    assert not (data_dir / "lmdb").exists()  # refused before anything was created


@pytest.mark.parametrize(
    "args",
    [
        ("--memory", "1.5"),
        ("--memory", "true"),
        ("--memory", "99999999999999999999999TiB"),
        ("--max-disk", "1KiB"),
        ("--max-disk", "-1"),
        ("--max-block", "0"),
        ("--max-block", "1.5"),
        ("--max-call", "nan"),
        ("--max-call", "0"),
        ("--quota", "0"),
        ("--quota", "-5MiB"),
        ("--min-rate", "fast"),
        ("--min-rate", "1.5"),
        ("--max-inflight", "0"),
        ("--max-inflight", "1e9"),
    ],
)
def test_serve_rejects_bad_sizes_with_one_error_line(tmp_path, args):
    flag = args[0]
    result = kvshelf_cli("serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"), *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "kvshelf serving" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert flag in lines[0], lines[0]
    assert not (tmp_path / "data").exists()  # nothing opened


def test_sizes_from_environment_and_config_file_name_their_source(tmp_path):
    from kvshelf.service.serve import load_config

    with pytest.raises(ConfigError, match=r"^\$KVSHELF_QUOTA: .*negative"):
        load_config({}, env={"KVSHELF_QUOTA": "-1GiB"})
    config_file = tmp_path / "serve.toml"
    config_file.write_text("memory = 1.5\n")
    with pytest.raises(ConfigError, match=r"serve\.toml: memory: .*whole number of bytes"):
        load_config({}, env={}, config_file=config_file)
    config_file.write_text("max_block = true\n")
    with pytest.raises(ConfigError, match=r"serve\.toml: max_block: "):
        load_config({}, env={}, config_file=config_file)


def test_serve_checks_a_config_built_in_python(tmp_path):
    from kvshelf.service.config import LimitsSection, ServerSection, StoreSection
    from kvshelf.service.serve import ServeConfig, serve

    with pytest.raises(ConfigError, match="^--max-inflight: "):
        ServeConfig.from_settings(listen="127.0.0.1:0", data_dir=str(tmp_path / "data"), max_inflight="1.5")
    data_dir = str(tmp_path / "data")
    config = ServeConfig(server=ServerSection(listen="127.0.0.1:0"), store=StoreSection(data_dir=data_dir),
                         limits=LimitsSection(max_inflight_bytes=0))
    stop = threading.Event()
    stop.set()  # were it to start, it would stop at once
    with pytest.raises(ConfigError, match="^--max-inflight: "):
        serve(config, stop=stop)
    assert not (tmp_path / "data").exists()
