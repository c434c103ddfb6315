"""Render the results tables of docs/benchmarks.md from the saved JSON files in bench/results.

    .venv/bin/python docs/gen_benchmarks.py          # rewrite the marked tables in docs/benchmarks.md
    .venv/bin/python docs/gen_benchmarks.py --check  # exit 1 when the page's tables are not the rendered ones

Each table stands between ``<!-- bench-table: NAME (bench/results/FILE.json) -->`` and ``<!-- /bench-table -->``;
its first line names the machine the JSON records. ``kvshelf.bench.tables.TABLES`` lists every results file with
the benchmark's function that builds its table(s) (the same one its ``run()`` prints). tests/test_docs.py fails
when the page differs from the rendering or a results file has no table in the page.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent / "benchmarks.md"
_BLOCK = re.compile(r"<!-- bench-table: (?P<name>[\w.-]+) \(bench/results/(?P<file>[\w.-]+)\) -->\n.*?"
                    r"<!-- /bench-table -->", re.DOTALL)


def problems(text: str) -> list[str]:
    """What keeps the page from being rendered: results files without a table, tables without a listing."""
    from kvshelf.bench.tables import TABLES, result_files

    listed = {t.file for t in TABLES}
    marked = {(m["name"], m["file"]) for m in _BLOCK.finditer(text)}
    out = [f"bench/results/{f}: not in kvshelf.bench.tables.TABLES" for f in result_files() if f not in listed]
    out += [f"bench/results/{t.file}: no table `{t.begin}` in docs/benchmarks.md" for t in TABLES
            if (t.name, t.file) not in marked]
    known = {(t.name, t.file) for t in TABLES}
    out += [f"docs/benchmarks.md: marker {name} ({file}) is not in kvshelf.bench.tables.TABLES"
            for name, file in sorted(marked - known)]
    return out


def render(text: str) -> str:
    """The page's text with every marked table rendered from its JSON file."""
    from kvshelf.bench.tables import TABLES
    from kvshelf.bench.tables import render as render_table

    by_marker = {(t.name, t.file): t for t in TABLES}

    def replace(match: re.Match[str]) -> str:
        entry = by_marker.get((match["name"], match["file"]))
        return match[0] if entry is None else render_table(entry)

    return _BLOCK.sub(replace, text)


def main(argv: list[str]) -> int:
    text = PAGE.read_text()
    found = problems(text)
    for problem in found:
        print(problem, file=sys.stderr)
    rendered = render(text)
    if "--check" in argv:
        if found or rendered != text:
            print("docs/benchmarks.md: the results tables differ from bench/results/*.json; run "
                  ".venv/bin/python docs/gen_benchmarks.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(rendered)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
