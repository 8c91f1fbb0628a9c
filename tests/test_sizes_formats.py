"""Sizes, file formats and the CLI's error plumbing (no torch, no solver)."""
import json

import pytest

from planner import cli
from planner.errors import UserError
from planner.formats import (PLAN_SCHEMA, Activation, LayerDecision, Profile, Tier,
                             load_plan, load_profile, write_json_atomic)
from planner.hardware import load_hardware, shipped_names
from planner.sizes import fmt_bytes, parse_size
from synthetic import uniform_profile


@pytest.mark.parametrize("text,expected", [
    ("80G", 80 * 1024**3), ("80GiB", 80 * 1024**3), ("80GB", 80 * 10**9),
    ("1.5T", int(1.5 * 1024**4)), ("512MiB", 512 * 1024**2), ("512MB", 512 * 10**6),
    ("123", 123), ("0", 0), ("4k", 4096), (" 2 G ", 2 * 1024**3), (7, 7),
    ("80gb", 80 * 10**9), ("2.0", 2), ("0.5K", 512), ("1.5B", None),
])
def test_parse_size(text, expected):
    if expected is None:               # a fraction of a byte, below
        with pytest.raises(UserError, match="fraction of a byte"):
            parse_size(text)
        return
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["80X", "-1G", "G", "", "1.2.3G", "80 GBs", -5,
                                  "0.1", "80Gb", "1Tb"])   # a tenth of a byte; gigabits
def test_parse_size_rejects(text):
    with pytest.raises(UserError) as e:
        parse_size(text, "--gpu-mem")
    assert "--gpu-mem" in str(e.value) and "\n" not in str(e.value)


def test_fmt_bytes():
    assert fmt_bytes(1536) == "1.50 KiB"
    assert fmt_bytes(80 * 1024**3) == "80.00 GiB"
    assert fmt_bytes(12) == "12 B"


def test_shipped_hardware_specs_load_and_cite_sources():
    names = shipped_names()
    for required in ("a100-80g", "h100-80g", "h200", "rtx4090", "cpu-host"):
        assert required in names
    for n in names:
        spec = load_hardware(n)
        assert spec.name == n
        assert spec.sources, f"{n} cites no sources"
        assert spec.flops_per_s("bf16") > 0
    assert load_hardware("cpu-host").unified_memory
    assert not load_hardware("h200").unified_memory


def test_unknown_hardware_is_one_line():
    with pytest.raises(UserError) as e:
        load_hardware("tpu-v9")
    assert "tpu-v9" in str(e.value) and "a100-80g" in str(e.value)


def test_profile_round_trip(tmp_path):
    prof = uniform_profile(3, load_hardware("a100-80g"), jitter=0.1)
    path = write_json_atomic(tmp_path / "p.json", prof.to_dict())
    again = load_profile(path)
    assert again == prof
    text = path.read_text()
    assert json.loads(text)["schema"] == "tierplan.profile/1"
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"old": true}')
    with pytest.raises(TypeError):
        write_json_atomic(path, {"bad": object()})
    assert json.loads(path.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_loaders_reject_bad_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_plan(bad)
    with pytest.raises(UserError, match="no such file"):
        load_plan(tmp_path / "missing.json")
    prof = uniform_profile(2, load_hardware("a100-80g"))
    p = write_json_atomic(tmp_path / "prof.json", prof.to_dict())
    with pytest.raises(UserError, match="this is a profile"):
        load_plan(p)
    wrong = write_json_atomic(tmp_path / "wrong.json", {"schema": PLAN_SCHEMA})
    with pytest.raises(UserError, match="lacks the field"):
        load_plan(wrong)


def test_layer_decision_round_trip():
    d = LayerDecision("blocks.3", Activation.RECOMPUTE, Tier.NONE)
    assert LayerDecision.from_dict(d.to_dict()) == d
    k = LayerDecision("blocks.4", Activation.KEEP)
    assert "checkpoint" not in k.to_dict()
    with pytest.raises(UserError, match="teleport"):
        LayerDecision.from_dict({"name": "x", "activation": "teleport"})


def test_cli_usage_errors_exit_2_one_line(capsys):
    assert cli.main(["solve"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "required" in err
    assert cli.main(["frobnicate"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_cli_help_on_every_verb_has_an_example(capsys):
    for verb in ("profile", "solve", "simulate", "upgrade", "inspect", "diff", "hardware"):
        with pytest.raises(SystemExit) as e:
            cli.main([verb, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert "example: plan " + verb in out
