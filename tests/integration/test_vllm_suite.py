"""tests/vllm, the connector's tests on a real vLLM engine, as part of `make test`'s own run.

vLLM lives in a venv of its own (`make vllm-venv`, which `make test` builds: vLLM's CPU build pins a transformers
below kvshelf's floor), so this test runs that venv's pytest on tests/vllm and passes when all of its tests pass.
Run here, it takes one of the suite's workers (and that worker's one torch thread) while the other goes on with the
rest of the suite. `make test-vllm` runs the same tests alone, with their own report."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTEST = REPO / ".venv-vllm" / "bin" / "pytest"

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not VLLM_PYTEST.exists(), reason="no .venv-vllm (make vllm-venv; `make test` builds it)")
def test_the_connector_passes_its_tests_on_a_real_vllm_engine(tmp_path: Path) -> None:
    # this worker's settings (under xdist, OMP_NUM_THREADS=1) without pytest's own: the run is a new session
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    report = tmp_path / "vllm.log"
    with report.open("w") as out:
        done = subprocess.run([str(VLLM_PYTEST), "-q", "-p", "no:cacheprovider", "-rfEs", "tests/vllm"], cwd=REPO,
                              env=env, stdout=out, stderr=subprocess.STDOUT, timeout=1800)
    text = report.read_text(errors="replace")
    summary = text.strip().splitlines()[-1] if text.strip() else "(no output)"
    assert done.returncode == 0, f"tests/vllm: {summary}\n{text[-6000:]}"
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", summary)}
    # every test ran (31 today; a collection that silently lost files would pass fewer): the vLLM venv has vLLM, so
    # nothing in tests/vllm may skip
    assert counts.get("passed", 0) >= 25 and not counts.get("skipped") and not counts.get("failed"), summary
