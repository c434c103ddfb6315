"""Helpers shared by benchmarks: corpus loading, machine description, JSON output, tables."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvshelf.kvstore.paths import cache_dir

CORPUS_ENV = "KVSHELF_CORPUS"


def default_corpus() -> Path | None:
    """The corpus when none is given: ``$KVSHELF_CORPUS``, else ``../shared/data/abstracts.jsonl`` relative to the
    current directory or its parent (a checkout's root or a folder in it), when present.

    Never derived from where the package is installed: an installed kvshelf has no checkout around it.
    """
    env = os.environ.get(CORPUS_ENV, "")
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise SystemExit(f"${CORPUS_ENV}={env}: no such file")
        return path
    cwd = Path.cwd()
    for base in (cwd, cwd.parent):
        candidate = base.parent / "shared" / "data" / "abstracts.jsonl"
        if candidate.is_file():
            return candidate
    return None


def results_path(name: str) -> Path:
    """Default place of a benchmark's JSON results: ``bench-results/NAME`` under the kvshelf cache."""
    return cache_dir() / "bench-results" / name


def load_corpus(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    """Records ``{"title", "abstract"}`` from a JSONL file."""
    records = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise SystemExit(f"corpus {path}: line {n} is not JSON: {exc}") from exc
    if not records:
        raise SystemExit(f"corpus {path} is empty")
    return records


def corpus_texts(path: str | os.PathLike[str] | None) -> Iterator[str]:
    """Texts from the corpus, or made-up abstracts (``bench/synthetic_abstracts.py``) when there is none."""
    if path is not None:
        records = load_corpus(path)
    else:
        from kvshelf.bench.synthetic_abstracts import make_abstracts

        records = make_abstracts()
    for record in records:
        yield f"{record.get('title', '')}. {record['abstract']}"


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)"


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def write_json(path: str | os.PathLike[str], payload: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def save_results(json_path: str | os.PathLike[str] | None, payload: dict[str, Any], console: Any) -> None:
    """Write a benchmark's JSON when a path was given, and say where."""
    if json_path:
        write_json(json_path, payload)
        console.print(f"wrote {json_path}")


def _vm_bytes(pid: int, field: str) -> int:
    """``field`` (``VmRSS``, ``VmHWM``...) of ``/proc/PID/status``, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/{pid}/status")


class PeakRss:
    """How much a process's peak RSS grew over a ``with`` block (``growth``, bytes; ``pid`` None: this process).

    ``/proc/PID/clear_refs`` resets the peak (``VmHWM``) at the start, where the kernel lets us (our own processes);
    elsewhere the peak since the process started counts."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.start = 0
        self.growth = 0

    def __enter__(self) -> PeakRss:
        with contextlib.suppress(OSError):
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
        self.start = _vm_bytes(self.pid, "VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.growth = max(0, _vm_bytes(self.pid, "VmHWM") - self.start)


def ensure_side_venv(venv: Path, requirements: list[list[str]], check_imports: str, console: Any, what: str,
                     uninstall: tuple[str, ...] = ()) -> tuple[Path | None, str | None]:
    """The python of a benchmark's own virtualenv ``venv`` (an anchor whose pins clash with kvshelf's), created on
    first use: one ``pip install`` per entry of ``requirements`` (in order), then ``uninstall``; it is ready when
    ``import {check_imports}`` runs. ``(None, reason)`` when a step fails; ``what`` is shown while it is built."""
    python = venv / "bin" / "python"
    check = [str(python), "-c", f"import {check_imports}"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python, None
    console.print(f"[dim]creating {venv} ({what}): a few minutes...[/dim]")
    steps = [[sys.executable, "-m", "venv", str(venv)],
             *([str(python), "-m", "pip", "install", "-q", *packages] for packages in requirements)]
    if uninstall:
        steps.append([str(python), "-m", "pip", "uninstall", "-q", "-y", *uninstall])
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            return None, f"`{' '.join(cmd[-3:])}` failed: {(done.stderr or done.stdout).strip()[-400:]}"
    if subprocess.run(check, capture_output=True).returncode != 0:
        return None, f"{python} cannot import {check_imports}"
    return python, None
