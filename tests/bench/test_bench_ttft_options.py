"""`kvshelf bench ttft --remote/--redis --codec ...`: options checked before any model loads, and the helpers that
name the codec variants and find their perplexity increase."""

from __future__ import annotations

import json

import pytest
from service_helpers import kvshelf_cli

from kvshelf.bench.ttft import codec_dppl_rel, codec_variants


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--codec", "int8,xquant"], "need --remote or --redis"),
        (["--codec", "int8", "--codec", "cachegen"], "need --remote or --redis"),
        (["--remote", "--codec", "int8,nope"], "nope"),
        (["--redis", "--codec", "int8,xquant", "--codec-params", '{"cachegen": {"bits": 4}}'], "cachegen"),
        (["--remote", "--codec", "int8,xquant", "--codec-params", '{"xquant": {"stepp": 1}}'], "stepp"),
        (["--remote", "--cold"], "--cold"),
    ],
)
def test_bad_remote_options_are_one_line(args, message):
    result = kvshelf_cli("bench", "ttft", *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2 and "Traceback" not in result.stderr


def test_codec_variants_put_raw_first_and_name_repeats():
    variants = codec_variants([("int8", {}), ("raw", {}), ("xquant", {"step": 0.35}), ("xquant", {"step": 0.5})])
    assert [(label, codec) for label, codec, _ in variants] == [
        ("raw", "raw"), ("int8", "int8"), ("xquant", "xquant"), ("xquant-2", "xquant")]
    assert variants[3][2] == {"step": 0.5}


def test_codec_dppl_rel_matches_defaults_and_tables(tmp_path):
    results = tmp_path / "codecs.json"
    results.write_text(json.dumps({"results": [
        {"codec": "int8", "params": {"group_size": 128}, "dppl_rel": 0.0001},
        {"codec": "xquant", "params": {"step": 0.35, "basis": "klt"}, "dppl_rel": 0.0034},
        {"codec": "xquant", "params": {"step": 0.35, "basis": "svd"}, "dppl_rel": 0.06},
    ]}))
    assert codec_dppl_rel("raw", {}, results) == 0.0
    assert codec_dppl_rel("int8", {}, results) == 0.0001  # the default group size is the measured one
    assert codec_dppl_rel("xquant", {"model": "digest-of-bound-tables"}, results) == 0.0034  # default step, klt
    assert codec_dppl_rel("xquant", {"basis": "svd"}, results) == 0.06
    assert codec_dppl_rel("int4", {}, results) is None  # not measured
    assert codec_dppl_rel("int8", {}, tmp_path / "missing.json") is None
