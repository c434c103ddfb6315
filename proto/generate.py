"""Regenerate the Python stubs of ``proto/kvshelf.proto`` (``make proto``; needs ``grpcio-tools``).

``python -m kvshelf.proto.generate [OUT_DIR]`` writes ``kvshelf_pb2.py``, ``kvshelf_pb2.pyi`` and
``kvshelf_pb2_grpc.py`` into ``OUT_DIR`` (default: this directory), with the generated ``import kvshelf_pb2``
made a package import (``from kvshelf.proto import kvshelf_pb2``) so the stubs work as
``kvshelf.proto.kvshelf_pb2_grpc``.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILE = PROTO_DIR / "kvshelf.proto"
STUBS = ("kvshelf_pb2.py", "kvshelf_pb2.pyi", "kvshelf_pb2_grpc.py")


def generate(out_dir: Path = PROTO_DIR) -> list[Path]:
    """Run protoc (from grpcio-tools) on ``kvshelf.proto``; return the stub paths written."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    rc = protoc.main([
        "grpc_tools.protoc", f"-I{PROTO_DIR}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}", str(PROTO_FILE),
    ])
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc} on {PROTO_FILE}")
    grpc_stub = out_dir / "kvshelf_pb2_grpc.py"
    text = grpc_stub.read_text()
    grpc_stub.write_text(text.replace("\nimport kvshelf_pb2 as ", "\nfrom kvshelf.proto import kvshelf_pb2 as "))
    return [out_dir / name for name in STUBS]


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR):
        print(path)
