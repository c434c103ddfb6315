"""Regenerate the Python stubs of ``proto/kvshelf.proto`` (``make proto``; needs ``grpcio-tools``).

``python -m kvshelf.proto.generate [OUT_DIR]`` writes ``kvshelf_pb2.py``, ``kvshelf_pb2.pyi`` and
``kvshelf_pb2_grpc.py`` into ``OUT_DIR`` (default: this directory), with the generated ``import kvshelf_pb2``
made a package import (``from kvshelf.proto import kvshelf_pb2``) so the stubs work as
``kvshelf.proto.kvshelf_pb2_grpc``.
"""

from __future__ import annotations

import ast
import re
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


def stub_contract(stub_dir: Path) -> dict[str, object]:
    """What the stubs in ``stub_dir`` define, apart from the protoc and grpcio versions that wrote them.

    ``descriptor``: the serialized ``FileDescriptorProto`` (every message, field, number, type, service and method);
    ``methods``: the gRPC method paths the client and server stubs use; ``pyi``: each class of the type stub with
    the names it declares. Two stubs with the same contract behave the same; their version stamps
    (``GRPC_GENERATED_VERSION``, ``ValidateProtobufRuntimeVersion``) may differ with the grpcio-tools a fresh
    install resolves.
    """
    from google.protobuf import descriptor_pb2

    pb2 = (stub_dir / STUBS[0]).read_text()
    found = re.search(r"AddSerializedFile\((b'.*?')\)\n", pb2, re.DOTALL)
    if found is None:
        raise ValueError(f"{stub_dir / STUBS[0]}: no serialized file descriptor")
    descriptor = descriptor_pb2.FileDescriptorProto.FromString(ast.literal_eval(found.group(1)))
    grpc_stub = (stub_dir / STUBS[2]).read_text()
    pyi = ast.parse((stub_dir / STUBS[1]).read_text())
    classes = {}
    for node in ast.walk(pyi):
        if isinstance(node, ast.ClassDef):
            names = set()
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                elif isinstance(item, ast.FunctionDef | ast.ClassDef):
                    names.add(item.name)
            classes[node.name] = sorted(names)
    return {
        "descriptor": descriptor,
        "methods": sorted(set(re.findall(r"'(/[\w.]+/\w+)'", grpc_stub))),
        "pyi": classes,
    }


def generated_versions(stub_dir: Path = PROTO_DIR) -> tuple[str, str]:
    """``(grpcio, protobuf)``: the versions the stubs in ``stub_dir`` were generated with (and need at least)."""
    grpc_version = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", (stub_dir / STUBS[2]).read_text())
    pb_version = re.search(r"# Protobuf Python Version: ([\d.]+)", (stub_dir / STUBS[0]).read_text())
    if grpc_version is None or pb_version is None:
        raise ValueError(f"{stub_dir}: the stubs carry no generator versions")
    return grpc_version.group(1), pb_version.group(1)


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR):
        print(path)
