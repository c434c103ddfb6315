"""``kvshelf --help`` and the help of the light commands load neither torch nor transformers (nor grpc, nor the
store): the command line imports them inside the commands that use them (``kvshelf/cli/__init__.py``). Each case
runs in a fresh interpreter, the only place where ``sys.modules`` tells what a command imported."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "grpc", "kvshelf.kvstore", "kvshelf.service", "kvshelf.adapters", "kvshelf.bench")
MARK = "heavy modules loaded: "

PROBE = f"""
import json, sys
from kvshelf.cli import main
sys.argv = ["kvshelf", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print("{MARK}" + json.dumps([code, sorted(m for m in {HEAVY!r} if m in sys.modules)]))
"""


def run_probe(*args: str) -> tuple[object, list[str], str]:
    """``kvshelf ARGS`` through ``main()`` in a fresh interpreter: (exit code, heavy modules it loaded, output)."""
    done = subprocess.run([sys.executable, "-P", "-c", PROBE, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, COLUMNS="120"))
    assert done.returncode == 0, done.stderr
    line = done.stdout.rstrip().splitlines()[-1]
    assert line.startswith(MARK), done.stdout
    code, loaded = json.loads(line.removeprefix(MARK))
    return code, loaded, done.stdout


@pytest.mark.parametrize("args", [["--help"], ["stats", "--help"], ["events", "--help"], ["bench", "--help"],
                                  ["serve", "--help"], ["bench", "ttft", "--help"], []],
                         ids=lambda args: " ".join(args) or "no arguments")
def test_help_loads_nothing_heavy(args: list[str]) -> None:
    code, loaded, output = run_probe(*args)
    assert code in (0, 2) and "Usage:" in output  # no arguments: the help, exit code 2 (click's)
    assert loaded == [], f"kvshelf {' '.join(args)} imported {loaded}"


def commands(output: str) -> list[str]:
    """The command names of a help page's Commands panel, in order."""
    panel = output[output.index("Commands"):]
    return re.findall(r"^│ (\S+) ", panel, flags=re.MULTILINE)


def test_every_command_is_listed_in_order() -> None:
    """The list in ``kvshelf/cli/__init__.py`` makes every command, in its order."""
    assert commands(run_probe("--help")[2]) == [
        "demo", "serve", "repair", "replay", "precompute", "prepare-model", "stats", "events", "bench"]
    assert commands(run_probe("bench", "--help")[2]) == [
        "replay", "eviction-bounds", "ttft", "rag", "serve", "pruning", "codecs", "mla", "lmdb", "lmdb-capacity",
        "store", "clear", "chaos", "abuse"]


def test_python_m_runs_the_command_line() -> None:
    done = subprocess.run([sys.executable, "-P", "-m", "kvshelf.cli", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "prepare-model" in done.stdout, done.stderr
