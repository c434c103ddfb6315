"""`kvshelf bench ...` options checked before any model loads: one readable line and exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
from service_helpers import REPO_ROOT


def _kvshelf(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from service.cli import main; main()", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


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
    result = _kvshelf("bench", "ttft", *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2 and "Traceback" not in result.stderr


@pytest.mark.parametrize("methods", ["bogus", "snapkv,nope", ","])
def test_bench_pruning_unknown_methods(methods):
    result = _kvshelf("bench", "pruning", "--methods", methods)
    assert result.returncode == 2, result.stderr
    assert "--methods: unknown" in result.stderr and "snapkv" in result.stderr
    assert "Traceback" not in result.stderr
