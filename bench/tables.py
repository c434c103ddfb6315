"""The benchmarks' results tables as markdown, rendered from the saved JSON files in ``bench/results``.

Each benchmark module builds its printed table(s) in a pure function of the saved payload (``results_table`` or
``results_tables``); ``TABLES`` names, for every results file, the marker of its table in docs/benchmarks.md and that
function. ``to_markdown`` turns a rich ``Table`` into a markdown table (header row, alignment from each column's
``justify``, rich markup dropped). docs/gen_benchmarks.py writes the rendered tables into the page between their
markers; tests/test_docs.py fails when the page differs or a results file has no table.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

RESULTS = Path(__file__).resolve().parent / "results"

_TTFT = "kvshelf.bench.ttft:results_table"


@dataclass(frozen=True)
class BenchTable:
    """One results file and the function that builds its table(s) from the file's payload."""

    name: str  # the marker's name in docs/benchmarks.md
    file: str  # under bench/results
    function: str  # "module:function"; returns a Table or a list of them

    @property
    def path(self) -> Path:
        return RESULTS / self.file

    @property
    def begin(self) -> str:
        return f"<!-- bench-table: {self.name} (bench/results/{self.file}) -->"

    def build(self) -> list[Table]:
        module, function = self.function.split(":")
        build: Callable[[dict[str, Any]], Table | list[Table]] = getattr(importlib.import_module(module), function)
        built = build(json.loads(self.path.read_text()))
        return built if isinstance(built, list) else [built]


END = "<!-- /bench-table -->"

TABLES: tuple[BenchTable, ...] = (
    BenchTable("ttft", "ttft.json", _TTFT),
    BenchTable("ttft-codec", "ttft_codec.json", _TTFT),
    BenchTable("ttft-codec-drop08", "ttft_codec_drop08.json", _TTFT),
    BenchTable("ttft-int8", "ttft_int8.json", _TTFT),
    BenchTable("ttft-codec-cold", "ttft_codec_cold.json", _TTFT),
    BenchTable("ttft-remote", "ttft_remote.json", _TTFT),
    BenchTable("ttft-remote-disk", "ttft_remote_disk.json", _TTFT),
    BenchTable("ttft-hybrid", "ttft_hybrid.json", _TTFT),
    BenchTable("ttft-hybrid-cuda", "ttft_hybrid_cuda.json", _TTFT),
    BenchTable("mla", "mla.json", "kvshelf.bench.mla:results_table"),
    BenchTable("gpu", "gpu.json", "kvshelf.bench.gpu:results_tables"),
    BenchTable("kv-events", "kv_events.json", "kvshelf.bench.kv_events:results_table"),
    BenchTable("gpu-int8", "gpu_int8.json", "kvshelf.bench.gpu:results_tables"),
    BenchTable("lmdb", "lmdb.json", "kvshelf.bench.lmdb_read:results_table"),
    BenchTable("store", "store.json", "kvshelf.bench.store:results_table"),
    BenchTable("store-floor", "store_floor.json", "kvshelf.bench.store:results_table"),
    BenchTable("store-datapath", "store_datapath.json", "kvshelf.bench.store:results_table"),
    BenchTable("clear", "clear.json", "kvshelf.bench.clear:results_table"),
    BenchTable("clear-cluster", "clear_cluster.json", "kvshelf.bench.clear:results_table"),
    BenchTable("replay-conversation", "replay_conversation.json", "kvshelf.bench.replay_report:results_table"),
    BenchTable("replay-synthetic", "replay_synthetic.json", "kvshelf.bench.replay_report:results_table"),
    BenchTable("eviction-bounds-conversation", "eviction_bounds_conversation.json",
               "kvshelf.bench.eviction_bounds:results_table"),
    BenchTable("eviction-bounds-synthetic", "eviction_bounds_synthetic.json",
               "kvshelf.bench.eviction_bounds:results_table"),
    BenchTable("lmdb-capacity", "lmdb_capacity.json", "kvshelf.bench.lmdb_capacity:results_table"),
    BenchTable("chaos", "chaos.json", "kvshelf.bench.chaos:results_table"),
    BenchTable("chaos-interval", "chaos_interval.json", "kvshelf.bench.chaos:results_table"),
    BenchTable("abuse", "abuse.json", "kvshelf.bench.abuse:results_tables"),
    BenchTable("abuse-int8", "abuse_int8.json", "kvshelf.bench.abuse:results_tables"),
    BenchTable("abuse-memory", "abuse_memory.json", "kvshelf.bench.abuse:results_tables"),
    BenchTable("abuse-600s", "abuse_600s.json", "kvshelf.bench.abuse:results_tables"),
    BenchTable("abuse-events", "abuse_events.json", "kvshelf.bench.abuse:results_tables"),
    BenchTable("codecs", "codecs.json", "kvshelf.bench.codecs:results_table"),
    BenchTable("codecs-synthetic", "codecs_synthetic.json", "kvshelf.bench.codecs:results_table"),
    BenchTable("codecs-xquant-cl", "codecs_xquant_cl.json", "kvshelf.bench.codecs:results_table"),
    BenchTable("rag", "rag.json", "kvshelf.bench.rag:results_tables"),
    BenchTable("pruning", "pruning.json", "kvshelf.bench.pruning:results_table"),
    BenchTable("pruning-snapkv", "pruning_snapkv.json", "kvshelf.bench.pruning:results_table"),
    BenchTable("longctx", "longctx.json", "kvshelf.bench.longctx:results_tables"),
    BenchTable("serve", "serve.json", "kvshelf.bench.serve:results_tables"),
    BenchTable("vllm", "vllm.json", "kvshelf.bench.vllm:results_tables"),
)


def _plain(cell: object) -> str:
    """A cell's text as the console shows it: rich markup dropped."""
    if isinstance(cell, Text):
        return cell.plain
    return Text.from_markup(str(cell)).plain


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("*", "\\*").replace("\n", " ")


_ALIGN = {"right": "---:", "center": ":---:"}


def to_markdown(table: Table) -> str:
    """The table in markdown: its title in bold above, its header row, an alignment row from each column's
    ``justify``, one row per row, its caption below."""
    lines = []
    if table.title:
        lines += [f"**{_escape(_plain(table.title))}**", ""]
    lines.append("| " + " | ".join(_escape(_plain(c.header)) for c in table.columns) + " |")
    lines.append("|" + "|".join(_ALIGN.get(str(c.justify), "---") for c in table.columns) + "|")
    cells = [list(c.cells) for c in table.columns]
    for i in range(table.row_count):
        lines.append("| " + " | ".join(_escape(_plain(column[i])) for column in cells) + " |")
    if table.caption:
        lines += ["", _escape(_plain(table.caption))]
    return "\n".join(lines)


def machine(payload: dict[str, Any]) -> str | None:
    """The machine a payload ran on: its ``machine``, or its first result's (abuse keeps it per phase)."""
    if payload.get("machine"):
        return str(payload["machine"])
    results = payload.get("results")
    if isinstance(results, list) and results and isinstance(results[0], dict) and results[0].get("machine"):
        return str(results[0]["machine"])
    return None


def render(entry: BenchTable) -> str:
    """One marked block: the begin marker, the machine (and the command when the JSON records one), the table(s),
    the end marker."""
    payload = json.loads(entry.path.read_text())
    ran_on = machine(payload)
    lines = [entry.begin,
             f"Machine: {ran_on}." if ran_on else f"Machine: not recorded in bench/results/{entry.file}."]
    if payload.get("command"):
        lines[-1] += f" Command: `{payload['command']}`."
    for table in entry.build():
        lines += ["", to_markdown(table)]
    lines.append(END)
    return "\n".join(lines)


def result_files() -> list[str]:
    """Every results file, by name."""
    return sorted(p.name for p in RESULTS.glob("*.json"))
