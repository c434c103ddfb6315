"""The wheel: built offline from a copy of the checkout's files, one import name (``kvshelf``), every subpackage
and the proto files in it, the ``kvshelf`` command; installed into a fresh virtualenv it imports next to
proto-plus's ``proto``.

Nothing is downloaded: the wheel is built with ``--no-build-isolation`` (setuptools and wheel come from the test
extra) and installed with ``--no-deps --no-index``; the fresh virtualenv sees this virtualenv's dependencies
through a ``.pth`` line naming its site-packages (``.pth`` files inside that directory are not processed, so the
editable install's finder stays out and only the wheel's ``kvshelf`` is importable).
"""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OFFLINE = {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess[str]:  # noqa: ANN003
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_")) and k != "VIRTUAL_ENV"}
    return {**env, **OFFLINE, **extra}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(source copy, wheel)``: the checkout's files copied out (as git sees them: tracked, plus new files not
    ignored; without git, the tree minus build outputs, virtualenvs and caches), and the wheel built from them."""
    root = tmp_path_factory.mktemp("packaging")
    src = root / "src"
    if (REPO / ".git").exists() and shutil.which("git") is not None:
        listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO).stdout
        for name in filter(None, listed.split("\0")):
            path = REPO / name
            if path.is_file():  # a tracked file deleted in the working tree is left out
                (src / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, src / name)
    else:
        shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
            ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache", "results"))
    dist = root / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(dist), str(src)], cwd=root, env=_env())
    wheels = list(dist.glob("kvshelf-*.whl"))
    assert len(wheels) == 1, wheels
    return src, wheels[0]


def _parts(src: Path) -> dict[str, Path]:
    """``kvshelf.X`` -> its folder in ``src``, from the package-dir mapping of ``pyproject.toml``."""
    mapping = tomllib.loads((src / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {package: src / folder for package, folder in mapping.items()}


def _dist_info(names: list[str], file: str) -> str | None:
    found = [n for n in names if n.split("/")[0].endswith(".dist-info") and n.endswith(f"/{file}")]
    return found[0] if found else None


def test_wheel_has_one_import_name(built: tuple[Path, Path]) -> None:
    _, wheel = built
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
        assert top == {"kvshelf"}, f"the wheel installs more than kvshelf: {sorted(top)}"
        top_level = _dist_info(names, "top_level.txt")
        if top_level:
            assert zf.read(top_level).decode().split() == ["kvshelf"]


def test_wheel_holds_every_subpackage_and_module(built: tuple[Path, Path]) -> None:
    """Every folder with an ``__init__.py`` under a mapped part is a package of the wheel, with all its modules:
    a new subpackage missing from ``[tool.setuptools] packages`` fails here."""
    src, wheel = built
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    missing = []
    for package, folder in _parts(src).items():
        for init in sorted(folder.rglob("__init__.py")):
            rel = init.parent.relative_to(folder).parts
            target = "/".join([*package.split("."), *rel])
            for module in sorted(init.parent.glob("*.py")):
                if f"{target}/{module.name}" not in names:
                    missing.append(f"{module.relative_to(src)} (as {target}/{module.name})")
    assert not missing, "not in the wheel (add the package to [tool.setuptools] packages):\n" + "\n".join(missing)
    stray = [n for n in names if n.endswith("/__init__.py") and "__pycache__" in n]
    assert not stray


def test_wheel_ships_the_proto_files_the_dashboard_and_the_command(built: tuple[Path, Path]) -> None:
    _, wheel = built
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for name in ("kvshelf.proto", "kvshelf_pb2.py", "kvshelf_pb2.pyi", "kvshelf_pb2_grpc.py"):
            assert f"kvshelf/proto/{name}" in names, name
        for name in ("index.html", "dashboard.js", "dashboard.css"):  # the admin dashboard's page: nothing fetched
            assert f"kvshelf/service/dashboard_assets/{name}" in names, name
        entry_points = _dist_info(sorted(names), "entry_points.txt")
        assert entry_points, "no entry_points.txt in the wheel"
        parser = configparser.ConfigParser()
        parser.read_string(zf.read(entry_points).decode())
    assert dict(parser["console_scripts"]) == {"kvshelf": "kvshelf.cli:main"}


CHECK = r"""
import importlib.metadata, importlib.util, json, sys
import kvshelf
import kvshelf.proto.kvshelf_pb2 as pb
proto = importlib.import_module("proto")  # proto-plus's package (ours is kvshelf.proto)
from kvshelf import KVBlock, KVShelfError, TieredStore, available_codecs, get_codec
from kvshelf.kvstore.encoding import decode_block, encode_block
from kvshelf.service.dashboard import load_asset
import torch

block = KVBlock(torch.ones(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), (1, 2, 3), 0, "fp")
back = decode_block(encode_block(block, b"k" * 16, "int8"))
print(json.dumps({
    "kvshelf": kvshelf.__file__, "pb": pb.__file__, "proto": proto.__file__,
    "proto_message": proto.Message.__module__, "message_fields": hasattr(proto, "Field"),
    "version": importlib.metadata.version("kvshelf"), "kvshelf_version": kvshelf.__version__,
    "codecs": available_codecs(), "round_trip": bool(torch.allclose(back.keys, block.keys, atol=0.01)),
    "errors": KVShelfError.__module__, "codec_module": get_codec.__module__,
    "store": TieredStore.__module__,
    "dashboard_page": b"/dashboard.js" in load_asset("index.html"),
    "bare": [n for n in ("kvstore", "compress", "reuse", "adapters", "service", "bench")
             if importlib.util.find_spec(n) is not None],
    "editable": [f.__class__.__module__ for f in sys.meta_path if "editable" in f.__class__.__module__],
}))
"""


def test_wheel_installs_and_imports_in_a_fresh_venv(built: tuple[Path, Path], tmp_path: Path) -> None:
    _, wheel = built
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env=_env())
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     env=_env()).stdout.strip())
    ours = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    (site / "_kvshelf_test_deps.pth").write_text("".join(f"{p}\n" for p in ours))
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
          str(wheel)], env=_env())

    neutral = tmp_path / "neutral"
    neutral.mkdir()
    env = _env(KVSHELF_CACHE=str(tmp_path / "cache"), HOME=str(tmp_path / "home"))
    out = json.loads(_run([str(python), "-I", "-c", CHECK], cwd=neutral, env=env).stdout.strip().splitlines()[-1])
    assert Path(out["kvshelf"]).resolve() == (site / "kvshelf" / "__init__.py").resolve(), out["kvshelf"]
    assert Path(out["pb"]).resolve() == (site / "kvshelf" / "proto" / "kvshelf_pb2.py").resolve()
    # a bare ``proto`` is proto-plus's, from the dependencies, never ours
    assert Path(out["proto"]).resolve().parent.parent in {Path(p).resolve() for p in ours}, out["proto"]
    assert out["proto_message"] == "proto.message" and out["message_fields"]
    assert out["version"] == out["kvshelf_version"]
    assert {"raw", "int8", "cachegen", "sparse", "xquant", "zstd"} <= set(out["codecs"])  # the lazy registry
    assert out["round_trip"]
    assert out["errors"] == "kvshelf.kvstore.errors" and out["store"] == "kvshelf.kvstore.store"
    assert out["codec_module"] == "kvshelf.kvstore.codec"
    assert out["dashboard_page"]  # the dashboard's page read from the installed package
    assert out["bare"] == [] and out["editable"] == []

    help_text = _run([str(venv / "bin" / "kvshelf"), "--help"], cwd=neutral, env=env).stdout
    assert "serve" in help_text and "bench" in help_text
