"""plan hardware: a spec in the shipped format, the probe directory left as found."""
import pytest

from planner.cli import main
from planner.hardware import load_hardware
from planner.hardware.measure import disk_bandwidth


def test_hardware_writes_a_loadable_spec(tmp_path, capsys):
    probe = tmp_path / "made" / "by" / "probe"
    out = tmp_path / "host.yaml"
    assert main(["hardware", "--nvme-dir", str(probe), "--size", "16M", "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert not (tmp_path / "made").exists()          # created levels removed, nothing else
    spec = load_hardware(str(out))
    assert spec.device in ("cpu", "cuda")
    assert set(spec.peak_flops) == {"bf16", "fp16", "fp32"}
    assert all(v > 0 for v in spec.peak_flops.values())
    assert spec.nvme_read_bandwidth > 0 and spec.nvme_write_bandwidth > 0
    assert spec.memory_bandwidth > 0 and spec.memory_bytes > 0
    if spec.device == "cpu":
        assert spec.unified_memory and spec.h2d_bandwidth == 0 and spec.host_memory_bytes == 0
    assert "nvme" in spec.sources and "peak_flops" in spec.sources


def test_existing_probe_dir_left_as_found(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    r = disk_bandwidth(tmp_path, 8 << 20)
    assert r["read"] > 0 and r["write"] > 0 and r["bytes"] == 8 << 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_hardware_bad_size(capsys):
    assert main(["hardware", "--size", "lots"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
