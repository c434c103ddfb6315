"""Test helpers shared by the kvstore/compress tests (plain functions, importable from any test module)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kvshelf.kvstore import KVBlock, chunk_key

FINGERPRINT = "fp-test-0123456789abcdef"
REPO_ROOT = Path(__file__).resolve().parents[2]


def make_block(
    tokens: int | Sequence[int] = 4,
    *,
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 8,
    fingerprint: str = FINGERPRINT,
    namespace: str = "default",
    start_pos: int = 0,
    dtype: torch.dtype = torch.float32,
    seed: int | None = None,
    extra: dict[str, str] | None = None,
) -> KVBlock:
    """A random but reproducible KVBlock.

    ``tokens`` is either a token count (ids ``start_pos, start_pos + 1, ...``) or the token ids themselves.
    Without ``seed`` the tensors are seeded from the token ids, start position and namespace, so the same
    arguments always give the same block and different token ids give different tensors.
    """
    token_ids = tuple(range(start_pos, start_pos + tokens)) if isinstance(tokens, int) else tuple(tokens)
    if seed is None:
        seed = zlib.crc32(repr((token_ids, start_pos, namespace, fingerprint)).encode())
    gen = torch.Generator().manual_seed(seed)
    shape = (layers, heads, len(token_ids), head_dim)
    keys = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    values = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    return KVBlock(
        keys=keys,
        values=values,
        token_ids=token_ids,
        start_pos=start_pos,
        fingerprint=fingerprint,
        namespace=namespace,
        extra=dict(extra or {}),
    )


def token_ids(n: int, seed: int = 1) -> list[int]:
    """``n`` seeded random token ids in [3, 500) (inside the tiny test model's vocabulary)."""
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def key_of(block: KVBlock) -> bytes:
    """The chunk key of ``block`` (content-addressed by its model, namespace and token ids)."""
    return chunk_key(block.fingerprint, block.namespace, block.token_ids)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).reshape(-1)


def assert_same_block(actual: KVBlock | None, expected: KVBlock) -> None:
    """Bit-exact equality of tensors plus equality of every metadata field."""
    assert actual is not None, "expected a block, got a miss"
    assert actual.keys.dtype == expected.keys.dtype
    assert actual.values.dtype == expected.values.dtype
    assert tuple(actual.keys.shape) == tuple(expected.keys.shape)
    assert tuple(actual.values.shape) == tuple(expected.values.shape)
    assert torch.equal(_bits(actual.keys), _bits(expected.keys)), "keys differ"
    assert torch.equal(_bits(actual.values), _bits(expected.values)), "values differ"
    assert actual.token_ids == expected.token_ids
    assert actual.start_pos == expected.start_pos
    assert actual.fingerprint == expected.fingerprint
    assert actual.namespace == expected.namespace
    assert actual.extra == expected.extra


def run_python(code: str, *args: str, hash_seed: str = "random") -> object:
    """Run ``code`` in a fresh interpreter (``sys.executable``); return the JSON of its last line."""
    env = dict(os.environ)
    env["PYTHONHASHSEED"] = hash_seed
    proc = subprocess.run(
        [sys.executable, "-P", "-c", code, *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"subprocess failed ({proc.returncode}):\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def word_ids(text: str) -> list[int]:
    """A toy tokenizer: one token per word."""
    return [3 + (sum(map(ord, w)) % 400) for w in text.split()]


class WordTokenizer:
    """A minimal tokenizer for the tiny models: one id per word (``word_ids``); decodes ids as numbers."""

    pad_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": word_ids(text)}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


SCHEMA_MARKUP = """
<schema name="support">
  <module name="system">you are a helpful assistant</module>
  <module name="manual" start="10">manual of <param name="product" len="3"/> read it well</module>
  <module name="faq" scope="prefix">frequent questions here</module>
</schema>
"""


def run_workers(worker: Callable[[int], None], count: int, *, timeout_s: float = 120) -> None:
    """Run ``worker(seed)`` for seeds ``0..count-1`` in threads at once; re-raise the first exception one raised."""
    errors: list[BaseException] = []

    def guarded(seed: int) -> None:
        try:
            worker(seed)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(seed,)) for seed in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout_s)
    if errors:
        raise errors[0]
