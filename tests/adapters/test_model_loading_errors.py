"""A model that cannot be loaded is one line saying why, at once and without the network: an unknown name, a path
that does not exist, a file, a directory without config.json, a model type transformers does not know, a model
that is not a causal LM (a real tiny T5 saved with ``save_pretrained``). In process (``load_model``, with an audit
hook that records every socket the call resolves or opens) and through ``kvshelf explain`` as a user runs it."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from service_helpers import kvshelf_cli

from kvshelf.adapters.model import load_model
from kvshelf.kvstore import open_embedded_store
from kvshelf.kvstore.errors import ModelLoadError

_NETWORK_EVENTS = {"socket.getaddrinfo", "socket.connect", "socket.gethostbyname", "socket.__new__"}
_watch = threading.local()


def _audit(event: str, args: tuple) -> None:
    seen = getattr(_watch, "seen", None)
    if seen is not None and event in _NETWORK_EVENTS:
        seen.append((event, repr(args)[:200]))


sys.addaudithook(_audit)  # one hook for the session (they cannot be removed); it records only inside `no_network`


@contextmanager
def no_network() -> Iterator[list]:
    """Record the sockets this thread creates, resolves or connects while inside."""
    _watch.seen = []
    try:
        yield _watch.seen
    finally:
        seen = _watch.seen
        _watch.seen = None
        assert seen == [], f"model loading touched the network: {seen}"


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real T5 checkpoint (random weights, tiny): an encoder-decoder, not a causal LM."""
    from transformers import T5Config, T5ForConditionalGeneration

    path = tmp_path_factory.mktemp("t5") / "tiny-t5"
    config = T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2)
    T5ForConditionalGeneration(config).save_pretrained(path)
    assert (path / "config.json").is_file()
    return path


def _refused(name: str) -> str:
    with no_network(), pytest.raises(ModelLoadError) as caught:
        load_model(name)
    message = str(caught.value)
    assert "\n" not in message and ".." not in message, message
    return message


def test_an_unknown_name_is_one_line_without_the_network() -> None:
    assert _refused("no-such-model") == (
        "unknown model name 'no-such-model' (not a local directory, nor a HF id in the local cache: models are "
        "never downloaded here); use a local directory or one of smollm2-135m")
    assert _refused("some-org/no-such-model").startswith("unknown model name 'some-org/no-such-model' (")


def test_a_path_that_does_not_exist_is_no_such_directory(tmp_path: Path) -> None:
    assert _refused("./no/such/dir") == "no such directory: ./no/such/dir"
    assert _refused(str(tmp_path / "missing")) == f"no such directory: {tmp_path / 'missing'}"


def test_a_directory_that_is_not_a_model(tmp_path: Path) -> None:
    assert _refused(str(tmp_path)) == f"not a model directory (no config.json): {tmp_path}"
    afile = tmp_path / "model.txt"
    afile.write_text("x")
    assert _refused(str(afile)) == f"not a directory: {afile} (give a model directory)"
    (tmp_path / "config.json").write_text("[1, 2]")
    assert _refused(str(tmp_path)) == f"not a model directory (its config.json is not a JSON object): {tmp_path}"
    (tmp_path / "config.json").write_text('{"model_type": "no-such-type"}')
    assert _refused(str(tmp_path)).startswith(f"unknown model type 'no-such-type' in the config.json of {tmp_path} ")


def test_an_encoder_decoder_is_not_a_causal_lm(t5_dir: Path) -> None:
    assert _refused(str(t5_dir)) == f"not a causal LM (model type t5): {t5_dir}"


def test_kvshelf_explain_says_it_in_one_line(t5_dir: Path, tmp_path: Path) -> None:
    open_embedded_store(tmp_path / "data").close()
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello there", encoding="utf-8")
    for model, says in ((str(t5_dir), f"not a causal LM (model type t5): {t5_dir}"),
                        ("no-such-model", "unknown model name 'no-such-model' ("),
                        ("./no/such/dir", "no such directory: ./no/such/dir")):
        done = kvshelf_cli("explain", "--model", model, "--prompt-file", str(prompt), "--data-dir",
                           str(tmp_path / "data"))
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {says}"), done.stderr
        assert "Retrying" not in done.stderr and "Use a local directory" not in done.stderr
