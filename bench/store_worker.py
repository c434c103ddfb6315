"""One client process of ``kvshelf bench store`` (``python -m bench.store_worker SPEC_JSON``).

Protocol over its pipes (JSON, no pickle): it connects, prints ``ready`` and waits for one line on stdin (the
common start of the warm-up), warms up, prints ``ready`` and waits for one more line (the common start of the timed
operations), runs them and prints one JSON object (``bench.store.client_work``).
"""

from __future__ import annotations

import json
import sys

from kvshelf.bench.store import client_work


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])

    def ready() -> None:
        print("ready", flush=True)
        sys.stdin.readline()

    report = client_work(spec["target"], spec["op"], spec["block_mib"], spec["clients"], spec["client"],
                         spec["ops"], ready)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
