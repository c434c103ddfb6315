"""Files written at run time live under ``$KVSHELF_CACHE`` (default ``~/.cache/kvshelf``), never in the package."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import kvshelf
from kvshelf.kvstore.paths import cache_dir

_OVERRIDES = ("KVSHELF_CACHE", "KVSHELF_MODEL_CACHE", "KVSHELF_DATA_DIR", "KVSHELF_KVPRESS_VENV", "KVSHELF_CORPUS")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No kvshelf path variable set, and a home directory of our own."""
    for name in _OVERRIDES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def _defaults() -> dict[str, Path]:
    from kvshelf.adapters.bundled import model_cache_dir
    from kvshelf.bench.common import results_path
    from kvshelf.bench.pruning import kvpress_venv
    from kvshelf.kvstore.embedded import default_data_dir

    return {"models": model_cache_dir(), "store": default_data_dir(), "venv-kvpress": kvpress_venv(),
            "bench-results": results_path("x.json").parent}


def test_cache_dir_defaults_to_home_cache(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert cache_dir() == tmp_path / "home" / ".cache" / "kvshelf"
    env.setenv("KVSHELF_CACHE", "")  # empty: as if unset
    assert cache_dir() == tmp_path / "home" / ".cache" / "kvshelf"


def test_cache_dir_honours_kvshelf_cache(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.setenv("KVSHELF_CACHE", str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"
    env.setenv("KVSHELF_CACHE", "~/kv")
    assert cache_dir() == tmp_path / "home" / "kv"


def test_every_default_lives_under_the_cache(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.setenv("KVSHELF_CACHE", str(tmp_path / "cache"))
    for name, path in _defaults().items():
        assert path == tmp_path / "cache" / name, name
    env.delenv("KVSHELF_CACHE")
    for name, path in _defaults().items():
        assert path == tmp_path / "home" / ".cache" / "kvshelf" / name, name


def test_per_use_overrides_win(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kvshelf.adapters.bundled import model_cache_dir
    from kvshelf.bench.pruning import kvpress_venv
    from kvshelf.kvstore.embedded import default_data_dir

    env.setenv("KVSHELF_CACHE", str(tmp_path / "cache"))
    env.setenv("KVSHELF_MODEL_CACHE", str(tmp_path / "models"))
    env.setenv("KVSHELF_DATA_DIR", str(tmp_path / "data"))
    env.setenv("KVSHELF_KVPRESS_VENV", str(tmp_path / "venv"))
    assert model_cache_dir() == tmp_path / "models"
    assert default_data_dir() == tmp_path / "data"
    assert kvpress_venv() == tmp_path / "venv"


def test_no_default_points_into_the_package(env: pytest.MonkeyPatch) -> None:
    """Even with the defaults, nothing kvshelf writes lands next to its code (installed or a checkout)."""
    package = Path(kvshelf.__file__).resolve().parent
    parts = [package, *(Path(p).resolve() for name in ("kvstore", "bench", "adapters", "service")
                        for p in importlib.import_module(f"kvshelf.{name}").__path__)]
    for name, path in _defaults().items():
        for part in parts:
            assert not path.resolve().is_relative_to(part), f"{name} default {path} is inside {part}"


def test_default_corpus_from_env_or_cwd(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kvshelf.bench.common import default_corpus

    checkout = tmp_path / "work" / "main"
    (checkout / "bench").mkdir(parents=True)
    env.chdir(checkout)
    assert default_corpus() is None
    corpus = tmp_path / "work" / "shared" / "data" / "abstracts.jsonl"
    corpus.parent.mkdir(parents=True)
    corpus.write_text('{"title": "t", "abstract": "a"}\n')
    assert default_corpus() == corpus  # ../shared/data from the checkout's root
    env.chdir(checkout / "bench")
    assert default_corpus() == corpus  # ... and from a folder inside it
    other = tmp_path / "mine.jsonl"
    other.write_text('{"title": "t", "abstract": "b"}\n')
    env.setenv("KVSHELF_CORPUS", str(other))
    assert default_corpus() == other
    env.setenv("KVSHELF_CORPUS", str(tmp_path / "missing.jsonl"))
    with pytest.raises(SystemExit, match="KVSHELF_CORPUS"):
        default_corpus()
