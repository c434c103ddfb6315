"""``kvshelf bench gpu`` on the CPU (``--device cpu``: the same code a GPU runs, on tiny shapes), its one line on a
machine without CUDA, and its bad inputs."""

from __future__ import annotations

import json

import pytest
import torch
from service_helpers import kvshelf_cli

pytestmark = pytest.mark.slow


def test_every_mode_and_codec_on_the_cpu(tmp_path) -> None:
    path = tmp_path / "gpu.json"
    result = kvshelf_cli("bench", "gpu", "--device", "cpu", "--dtype", "float32", "--models",
                         "smollm2-135m-shaped:2", "--lengths", "300,600", "--codecs", "raw,int8", "--runs", "1",
                         "--gpu-bytes", "256MiB", "--memory-bytes", "256MiB", "--codec-max-tokens", "300",
                         "--json", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    payload = json.loads(path.read_text())
    rows = {(r["tokens"], r["mode"], r["codec"]): r for r in payload["results"]}
    for n in (300, 600):
        for mode, codec in (("full", "-"), ("warm-gpu", "decoded"), ("warm-cpu", "raw"), ("warm-lmdb", "raw"),
                            ("warm-remote", "raw")):
            row = rows[(n, mode, codec)]
            assert row["same_output"], row  # exact paths give the full prefill's tokens
            assert row["reused_tokens"] == (0 if mode == "full" else n - n % 256)
    assert (300, "warm-cpu", "int8") in rows and (600, "warm-cpu", "int8") not in rows  # --codec-max-tokens
    assert any("--codec-max-tokens 300" in line for line in payload["skipped"])
    assert rows[(600, "warm-cpu", "raw")]["load_gb_s"] > 0 and payload["copy_gb_s"] is None  # no card to copy to
    decode = {r["codec"]: r for r in payload["decode"]}
    assert decode["raw"]["decoded_bytes"] == decode["int8"]["decoded_bytes"] > decode["int8"]["encoded_bytes"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the line a machine without CUDA prints")
def test_without_cuda_one_line_and_exit_0() -> None:
    result = kvshelf_cli("bench", "gpu")
    assert result.returncode == 0 and "no CUDA device on this machine" in result.stdout
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--modes", "warm-tpu"], "unknown ['warm-tpu']"),
    (["--codecs", "nocodec"], "nocodec"),
    (["--lengths", "a,b"], "--lengths"),
    (["--dtype", "float7"], "float7"),
])
def test_bad_inputs_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = kvshelf_cli("bench", "gpu", "--device", "cpu", *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
