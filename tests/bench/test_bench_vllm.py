"""`kvshelf bench vllm`: bad options refused in one line before any work (no engine), and the smallest real run
(vLLM alone and kvshelf's connector over an embedded store, 512 tokens, one document) writing its schema with the
connector's greedy tokens equal to vLLM's and the warm engine process loading what the cold one stored."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from kvshelf.bench.vllm import Options, check, run, vllm_venv
from kvshelf.kvstore.errors import ConfigError

pytestmark = pytest.mark.slow  # a whole benchmark run: scheduled first (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
#: the keys of a result row, in order (the schema bench/vllm.py's docstring states)
ROW_KEYS = ("system", "workload", "phase", "tokens", "ttft_p50_s", "ttft_p99_s", "tpot_s", "requests_per_s",
            "hit_tokens_fraction", "same_output")


@pytest.mark.parametrize(("options", "message"), [
    (Options(systems=("vllm", "sglang")), "--systems: unknown ['sglang']"),
    (Options(systems=()), "--systems: unknown empty"),
    (Options(systems=("vllm", "vllm")), "names a system twice"),
    (Options(lengths=(1000,)), "multiples of 128"),
    (Options(qa_tokens=128), "at least 256"),
    (Options(questions=0), "--questions must be at least 1"),
    (Options(questions=6), "--questions must be at most 5"),
    (Options(max_tokens=1), "--max-tokens must be at least 2"),
    (Options(kv_blocks=8), "--kv-blocks 8 holds 1024 tokens, less than one request"),
])
def test_bad_options_are_refused(options: Options, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check(options)


@pytest.mark.parametrize("args", [["--systems", "vllm,tgi"], ["--lengths", "4096,x"], ["--ttft-docs", "0"],
                                  ["--vllm-venv", "/nonexistent/venv"]])
def test_the_command_refuses_bad_options_in_one_line(args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "kvshelf.cli", "bench", "vllm", *args], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = [s for s in done.stderr.strip().splitlines() if s.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), done.stderr


def _vllm_python() -> Path | None:
    python = vllm_venv(str(REPO / ".venv-vllm")) / "bin" / "python"
    return python if python.exists() else None


@pytest.mark.skipif(_vllm_python() is None, reason="no .venv-vllm (make vllm-venv)")
def test_smallest_run_writes_its_schema_and_the_same_tokens(tmp_path: Path) -> None:
    out = tmp_path / "vllm.json"
    options = Options(systems=("vllm", "kvshelf"), lengths=(512,), ttft_docs=1, qa_docs=2, qa_tokens=256,
                      questions=1, max_tokens=4, kv_blocks=8)
    payload = run(json_path=str(out), corpus=None, options=options, vllm_venv_dir=str(REPO / ".venv-vllm"),
                  console=Console(quiet=True), command="test")
    written = json.loads(out.read_text())
    assert written["results"] == payload["results"] and written["status"] == "complete"
    assert {"machine", "command", "notes", "figures"} <= set(written)
    rows = {(r["system"], r["workload"], r["phase"]): r for r in written["results"]}
    assert set(rows) == {(s, "ttft", p) for s in ("vllm", "kvshelf") for p in ("cold", "warm")} | {
        (s, "long_doc_qa", None) for s in ("vllm", "kvshelf")}
    for r in written["results"]:
        assert tuple(r) == ROW_KEYS, r
        assert r["same_output"] is True, r
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"], r
        assert r["tpot_s"] > 0, r
    assert rows[("kvshelf", "ttft", "cold")]["hit_tokens_fraction"] == 0.0
    # the warm engine is a new process: its hits are what the cold one stored (512 of 512 + question tokens)
    assert rows[("kvshelf", "ttft", "warm")]["hit_tokens_fraction"] > 0.8
    assert rows[("vllm", "ttft", "warm")]["hit_tokens_fraction"] > 0.8  # its own prefix cache
    assert rows[("vllm", "long_doc_qa", None)]["requests_per_s"] > 0
    assert rows[("kvshelf", "long_doc_qa", None)]["requests_per_s"] > 0
