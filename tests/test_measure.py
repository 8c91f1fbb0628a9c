"""plan hardware: a spec in the shipped format, the probe directory left as found, the disk
measured in requests with several in flight (O_DIRECT or a stated fallback), the CPU AdamW rate
on the runtime's threads, and one line for every bad option."""
import os

import pytest

from planner.cli import main
from planner.hardware import load_hardware
from planner.hardware import measure
from planner.hardware.measure import adamw_rate, disk_bandwidth


def test_hardware_writes_a_loadable_spec(tmp_path, capsys):
    import torch
    probe = tmp_path / "made" / "by" / "probe"
    out = tmp_path / "host.yaml"
    assert main(["hardware", "--nvme-dir", str(probe), "--size", "16M", "--request", "256K",
                 "--in-flight", "3", "--adam-params", "64K", "-o", str(out)]) == 0
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
    assert "256.00 KiB requests, 3 in flight" in spec.sources["nvme"]
    assert spec.cpu_adam_params_per_s > 0 and spec.cpu_adam_cores == torch.get_num_threads()
    assert "65536 fp32 parameters" in spec.sources["cpu_adam_params_per_s"]
    assert spec.nvme_drives == 0                      # the tier measured as a whole


def test_existing_probe_dir_left_as_found(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    r = disk_bandwidth(tmp_path, 8 << 20)
    assert r["read"] > 0 and r["write"] > 0 and r["bytes"] == 8 << 20
    assert r["request"] == 1 << 20 and r["in_flight"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_requests_cover_the_size_in_whole_requests(tmp_path, monkeypatch):
    seen = []
    real = os.pwrite

    def pwrite(fd, data, offset):
        seen.append((offset, len(data)))
        return real(fd, data, offset)
    monkeypatch.setattr(os, "pwrite", pwrite)
    r = disk_bandwidth(tmp_path, 5 * 65536 + 100, request=65536, in_flight=3)
    assert r["bytes"] == 5 * 65536                    # whole requests only
    body = sorted(s for s in seen if s[1] == 65536)
    assert body == [(i * 65536, 65536) for i in range(5)]   # each once, whatever the thread


def test_o_direct_refused_falls_back_with_a_note(tmp_path, monkeypatch, capsys):
    real = os.open

    def no_direct(path, flags, *a, **k):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")
        return real(path, flags, *a, **k)
    monkeypatch.setattr(os, "open", no_direct)
    r = disk_bandwidth(tmp_path, 1 << 20, request=1 << 18)
    assert not r["direct"] and "refuses O_DIRECT (Invalid argument)" in r["method"]
    assert "fsync" in r["method"] and r["read"] > 0
    monkeypatch.setattr(measure, "matmul_rates", lambda device, n: {"fp32": 1e9})
    out = tmp_path / "h.yaml"
    assert main(["hardware", "--nvme-dir", str(tmp_path / "p"), "--size", "1M",
                 "--adam-params", "4K", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "note: no O_DIRECT" in err and len(err.strip().splitlines()) == 1
    assert "refuses O_DIRECT" in load_hardware(str(out)).sources["nvme"]


def test_adamw_rate_counts_what_it_steps(monkeypatch):
    import torch
    r = adamw_rate(1001, repeats=1)
    assert r["params"] == 1001 and r["params_per_s"] > 0
    assert r["threads"] == torch.get_num_threads() and r["kernel"] in ("fused", "foreach")
    real = torch.optim.AdamW

    def no_fused(params, fused=None, **k):
        if fused:
            raise RuntimeError("fused AdamW needs CUDA")
        return real(params, **k)
    monkeypatch.setattr(torch.optim, "AdamW", no_fused)
    assert adamw_rate(64, repeats=1)["kernel"] == "foreach"


@pytest.mark.parametrize("args,needle", [
    (["--size", "lots"], "--size"),
    (["--size", "0"], "--size"),
    (["--request", "1000"], "--request"),
    (["--request", "128M"], "--request"),
    (["--request", "0"], "--request"),
    (["--size", "512K", "--request", "1M"], "smaller than one --request"),
    (["--in-flight", "0"], "--in-flight"),
    (["--in-flight", "65"], "--in-flight"),
    (["--in-flight", "two"], "--in-flight"),
    (["--in-flight", "-3"], "--in-flight"),
    (["--adam-params", "2"], "--adam-params"),
    (["--adam-params", "many"], "--adam-params"),
    (["--adam-params", "3G"], "--adam-params"),
])
def test_hardware_bad_options_are_one_line(args, needle, capsys):
    assert main(["hardware", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_by_default_the_disk_is_measured_in_the_requests_the_runtime_issues(tmp_path):
    """Without --request and --in-flight the probe issues what the runtime's disk I/O does on
    this host (runtime/disk.py, ``io_requests``), so the spec's rates are the ones its plans
    will see."""
    import torch

    from planner.formats import io_requests
    out = tmp_path / "host.yaml"
    assert main(["hardware", "--nvme-dir", str(tmp_path / "p"), "--size", "8M",
                 "--adam-params", "64K", "-o", str(out)]) == 0
    request, in_flight = io_requests(not torch.cuda.is_available(), 1)
    want = f"{request // 1024}.00 KiB" if request < 1 << 20 else f"{request >> 20}.00 MiB"
    assert f"{want} requests, {in_flight} in flight" in load_hardware(str(out)).sources["nvme"]
