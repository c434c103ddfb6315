"""``kvshelf explain``: on a prompt stored in an embedded store, on the same prompt cut in other blocks, and on bad
input (a missing prompt file, a directory with no store), in a subprocess as a user runs it. The model is
``smollm2-135m-shaped:2`` (SmolLM2's tokenizer, two layers of random weights, seeded: the same fingerprint in
every process)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from service_helpers import kvshelf_cli

from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.model import load_model
from kvshelf.kvstore import open_embedded_store

MODEL = "smollm2-135m-shaped:2"
PROMPT = ("A key-value cache keeps the attention state of a prompt, so that a model that sees the same context "
          "again reads it back instead of computing it. ") * 3


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    """A data directory holding PROMPT's 16-token blocks, the prompt file, and the prompt's length in tokens."""
    root = tmp_path_factory.mktemp("explain")
    model, tokenizer = load_model(MODEL)
    with open_embedded_store(root / "data") as store, CachedGenerator(model, tokenizer, store, block_size=16) as gen:
        result = gen.generate(PROMPT, max_new_tokens=1, wait=True)
    prompt_file = root / "prompt.txt"
    prompt_file.write_text(PROMPT, encoding="utf-8")
    return root / "data", prompt_file, len(result.prompt_ids)


def _explain(data: Path, prompt_file: Path, *args: str):  # noqa: ANN202
    return kvshelf_cli("explain", "--model", MODEL, "--prompt-file", str(prompt_file), "--data-dir", str(data),
                       *args)


def test_a_stored_prompt_is_a_full_hit(stored: tuple[Path, Path, int]) -> None:
    data, prompt_file, tokens = stored
    done = _explain(data, prompt_file, "--block-size", "16")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"{tokens} prompt tokens, {tokens // 16} blocks of 16: {tokens // 16} held ({tokens // 16 * 16} tokens): "
        "a full hit"]


def test_a_prompt_stored_in_other_blocks_says_so_in_one_line(stored: tuple[Path, Path, int]) -> None:
    data, prompt_file, tokens = stored
    done = _explain(data, prompt_file, "--block-size", "32", "--namespace", "default")
    assert done.returncode == 0, done.stderr
    head, *findings = done.stdout.splitlines()
    assert head == f"{tokens} prompt tokens, {tokens // 32} blocks of 32: 0 held (0 tokens)"
    assert findings == [f"other_block_size: {tokens // 16} blocks ({tokens // 16 * 16} tokens) of this prompt are "
                        "stored in blocks of 16 tokens; this generator cuts blocks of 32: use block_size=16"]


def test_another_namespace_is_found_among_the_stores(stored: tuple[Path, Path, int]) -> None:
    data, prompt_file, _ = stored
    done = _explain(data, prompt_file, "--block-size", "16", "--namespace", "tenant-b")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1].startswith("other_namespace: ")
    assert "stored in namespace 'default'" in done.stdout


def test_bad_input_is_one_line_and_exit_code_2(stored: tuple[Path, Path, int], tmp_path: Path) -> None:
    data, prompt_file, _ = stored
    missing = _explain(data, tmp_path / "nope.txt")
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [f"error: no such prompt file: {tmp_path / 'nope.txt'}"]
    no_store = _explain(tmp_path / "empty", prompt_file)
    assert no_store.returncode == 2
    assert len(no_store.stderr.strip().splitlines()) == 1 and "no kvshelf store at" in no_store.stderr


def test_blocks_stored_in_float32_explained_to_a_bfloat16_model(stored: tuple[Path, Path, int]) -> None:
    data, prompt_file, tokens = stored
    done = _explain(data, prompt_file, "--block-size", "16", "--dtype", "bfloat16")
    assert done.returncode == 0, done.stderr
    head, *findings = done.stdout.splitlines()
    assert head == f"{tokens} prompt tokens, {tokens // 16} blocks of 16: 0 held (0 tokens)"
    assert len(findings) == 1 and findings[0].startswith(
        f"other_dtype: {tokens // 16} blocks ({tokens // 16 * 16} tokens) of this prompt are stored in float32 ")
    assert "load the model in float32 to reuse them" in findings[0]


def test_threads_sets_torch_threads_for_the_command(stored: tuple[Path, Path, int],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``--threads 1`` (in process, typer's runner): torch runs one intra-op thread, and the processes the command
    starts inherit ``OMP_NUM_THREADS=1``."""
    import torch
    from typer.testing import CliRunner

    from kvshelf.cli import app

    data, prompt_file, _ = stored
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        done = CliRunner().invoke(app, ["explain", "--model", MODEL, "--prompt-file", str(prompt_file), "--data-dir",
                                        str(data), "--block-size", "16", "--threads", "1"])
        assert done.exit_code == 0, done.output
        assert "a full hit" in done.output
        assert torch.get_num_threads() == 1
        assert os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        torch.set_num_threads(before)
