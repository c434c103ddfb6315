"""The configuration of ``kvshelf serve`` (service/config.py): one source for the flags, the environment, the TOML
keys, the docs and ``ServerLimits``; sizes parsed once; the shared tier's URL through the tier registry."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvshelf.kvstore.embedded import MIN_DISK_BYTES
from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.eviction import DEFAULT_POLICY
from kvshelf.service import config as cfg
from kvshelf.service.server import ServerLimits

REPO = Path(__file__).resolve().parents[2]


def test_constants_mirror_the_store() -> None:
    assert cfg.MIN_DISK_BYTES == MIN_DISK_BYTES and cfg.DEFAULT_POLICY == DEFAULT_POLICY


def test_server_limits_come_from_the_sections_without_renaming() -> None:
    names = [f.name for s in ("limits", "fairness", "events") for f in dataclasses.fields(cfg.SECTIONS[s])]
    server = ["shared_memory", "data_path", "data_port"]  # the server section's
    assert sorted([*names, *server]) == sorted(f.name for f in dataclasses.fields(ServerLimits))
    assert cfg.ServeConfig().server_limits() == ServerLimits()  # the same defaults
    config = cfg.load_config({"max_block": "1MiB", "quota": "2GiB", "strike_rate": "2.5", "events_log": "8KiB",
                              "shared_memory": False}, env={})
    limits = config.server_limits()
    assert (limits.max_block_bytes, limits.quota_bytes, limits.strike_leak_per_s, limits.events_log_bytes,
            limits.shared_memory) == (1 << 20, 2 << 30, 2.5, 8 << 10, False)


def test_every_setting_has_a_flag_an_environment_variable_and_help() -> None:
    help_text = subprocess.run([sys.executable, "-P", "-m", "kvshelf.cli", "serve", "--help"], cwd=REPO,
                               capture_output=True, text=True, timeout=120, env={"COLUMNS": "400", "PATH": ""}).stdout
    for spec in cfg.SETTINGS:
        assert spec.help and spec.env == "KVSHELF_" + spec.key.upper()
        assert re.search(rf"{re.escape(spec.flag)}\b", help_text), spec.flag
    assert "--config" in help_text


def test_sizes_are_parsed_once_into_bytes(tmp_path: Path) -> None:
    config = cfg.load_config({"memory": "64MiB"}, env={"KVSHELF_MAX_DISK": "2GiB"})
    assert (config.store.memory_bytes, config.store.max_disk_bytes) == (64 << 20, 2 << 30)
    assert (config.limits.quota_bytes, config.limits.max_inflight_bytes) == (None, None)  # unset
    assert cfg.load_config({}, env={}) == cfg.ServeConfig()


def test_section_tables_in_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "serve.toml"
    path.write_text('[serve.store]\nmemory = "1GiB"\n[serve.limits]\nquota = "5MiB"\n[serve]\nlisten = "h:1"\n')
    config = cfg.load_config({}, env={}, config_file=path)
    assert (config.store.memory_bytes, config.limits.quota_bytes, config.server.listen) == (1 << 30, 5 << 20, "h:1")
    path.write_text('[serve.store]\nquota = "5MiB"\n')
    with pytest.raises(ConfigError, match=r"unknown setting \[store\] 'quota'"):
        cfg.load_config({}, env={}, config_file=path)


@pytest.mark.parametrize("page", ["docs/configuration.md", "examples/serve.toml"])
def test_documented_config_files_load(page: str, tmp_path: Path) -> None:
    text = (REPO / page).read_text()
    blocks = re.findall(r"```toml\n(.*?)```", text, flags=re.DOTALL) if page.endswith(".md") else [text]
    assert blocks
    for block in blocks:
        path = tmp_path / "serve.toml"
        path.write_text(block)
        cfg.load_config({}, env={}, config_file=path)


@pytest.mark.parametrize("scheme", cfg.REDIS_SCHEMES)
def test_redis_accepts_every_redis_scheme_of_the_registry(scheme: str) -> None:
    assert cfg.load_config({"redis": f"{scheme}://127.0.0.1:6379"}, env={}).store.redis.startswith(scheme)


@pytest.mark.parametrize("url, message", [
    ("http://cache:6379", r"^--redis: 'http://cache:6379' is not a Redis URL; use one of redis://, rediss://"),
    ("memory://", r"^--redis: 'memory://' is not a Redis URL"),
    ("cache:6379", r"^--redis: 'cache:6379' is not a Redis URL"),
    ("rediss+cluster://", r"^--redis: tier URL 'rediss\+cluster://': a Redis URL needs a host"),
])
def test_bad_redis_urls_are_named(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        cfg.load_config({"redis": url}, env={})


def test_serve_rejects_a_bad_tier_url_with_one_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-P", "-m", "kvshelf.cli", "serve", "--listen", "127.0.0.1:0",
                           "--data-dir", str(tmp_path / "data"), "--redis", "foo://x"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --redis: 'foo://x' is not a Redis URL"), done.stderr
    assert not (tmp_path / "data").exists()
