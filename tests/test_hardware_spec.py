"""The hardware spec's NVMe array and CPU Adam fields: the tier's aggregate derived from the
drives, old specs unchanged, ``with_nvme_drives``, and one UserError line for every bad value."""
import random

import pytest
import yaml

from planner.errors import UserError
from planner.formats import HardwareSpec, with_nvme_drives
from planner.hardware import HARDWARE_DIR, load_hardware, shipped_names


def _base(**over):
    d = load_hardware("rtx4090").to_dict()
    for k in ("nvme_drives", "nvme_drive_read_bandwidth", "nvme_drive_write_bandwidth",
              "nvme_striping_efficiency", "nvme_read_bandwidth", "nvme_write_bandwidth"):
        d.pop(k, None)
    d.update(over)
    return {k: v for k, v in d.items() if v is not None}


def _load(d):
    return HardwareSpec.from_dict(d, "t.yaml")


def _one_line(d, *needles):
    with pytest.raises(UserError) as e:
        _load(d)
    msg = str(e.value)
    assert "\n" not in msg and "t.yaml" in msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


ARRAY = dict(nvme_drives=12, nvme_drive_read_bandwidth=6.5e9, nvme_drive_write_bandwidth=3.4e9,
             nvme_striping_efficiency=0.9)


def test_array_gives_the_tier_aggregate():
    s = _load(_base(**ARRAY))
    assert s.nvme_read_bandwidth == pytest.approx(12 * 6.5e9 * 0.9)
    assert s.nvme_write_bandwidth == pytest.approx(12 * 3.4e9 * 0.9)
    one = _load(_base(**{**ARRAY, "nvme_drives": 1}))      # one drive is itself, not striped
    assert (one.nvme_read_bandwidth, one.nvme_write_bandwidth) == (6.5e9, 3.4e9)
    # both given and agreeing: loads; the round trip keeps every field
    both = _base(**ARRAY, nvme_read_bandwidth=70.2e9, nvme_write_bandwidth=36.72e9)
    assert _load(both).nvme_read_bandwidth == pytest.approx(70.2e9)
    assert _load(s.to_dict()) == s


def test_old_specs_keep_their_meaning_and_their_dict():
    for name in shipped_names():
        s = load_hardware(name)
        raw = yaml.safe_load((HARDWARE_DIR / f"{name}.yaml").read_text())
        if "nvme_drives" not in raw:
            assert s.nvme_read_bandwidth == raw["nvme_read_bandwidth"]
            assert not set(s.to_dict()) & {"nvme_drives", "nvme_drive_read_bandwidth",
                                           "nvme_striping_efficiency"}
        assert _load(s.to_dict()) == s


def test_with_nvme_drives():
    s = _load(_base(**ARRAY, nvme_bytes=12 * 3_840_000_000_000))
    for n in (1, 2, 3, 6, 12, 24):
        t = with_nvme_drives(s, n)
        per = 6.5e9 if n == 1 else n * 6.5e9 * 0.9
        assert t.nvme_drives == n and t.nvme_read_bandwidth == pytest.approx(per)
        assert t.nvme_write_bandwidth == pytest.approx(3.4e9 if n == 1 else n * 3.4e9 * 0.9)
        assert t.nvme_bytes == n * 3_840_000_000_000
        assert t.nvme_drive_read_bandwidth == 6.5e9 and f"{n} drives" in t.sources["nvme_drives"]
        assert _load(t.to_dict()) == t                   # what it makes loads as itself
    assert s.nvme_drives == 12                           # pure: the spec is unchanged
    for bad in (0, -1, 1.5, True, 10**6, "2"):
        with pytest.raises(UserError, match="--nvme-drives"):
            with_nvme_drives(s, bad)
    with pytest.raises(UserError, match="nvme_drives"):
        with_nvme_drives(load_hardware("a100-80g"), 2)   # a single tier figure: no drives


BAD = [
    (dict(ARRAY, nvme_drives=-1), "nvme_drives"),
    (dict(ARRAY, nvme_drives=2.0), "nvme_drives"),
    (dict(ARRAY, nvme_drives=True), "nvme_drives"),
    (dict(ARRAY, nvme_drives=5000), "nvme_drives"),
    (dict(ARRAY, nvme_drives="12"), "nvme_drives"),
    (dict(ARRAY, nvme_drive_read_bandwidth=-6.5e9), "nvme_drive_read_bandwidth"),
    (dict(ARRAY, nvme_drive_write_bandwidth=float("nan")), "nvme_drive_write_bandwidth"),
    (dict(ARRAY, nvme_drive_write_bandwidth=1e300), "nvme_drive_write_bandwidth"),
    (dict(ARRAY, nvme_striping_efficiency=0), "nvme_striping_efficiency"),
    (dict(ARRAY, nvme_striping_efficiency=1.2), "nvme_striping_efficiency"),
    (dict(ARRAY, nvme_striping_efficiency="0.9"), "nvme_striping_efficiency"),
    (dict(ARRAY, nvme_drive_write_bandwidth=0), "not nvme_drive_write_bandwidth"),
    (dict(nvme_drives=4), "not nvme_drive_read_bandwidth"),
    (dict(nvme_drive_read_bandwidth=6.5e9, nvme_drive_write_bandwidth=3e9), "not nvme_drives"),
    (dict(nvme_striping_efficiency=0.9, nvme_read_bandwidth=1e9, nvme_write_bandwidth=1e9),
     "nvme_striping_efficiency without"),
    (dict(ARRAY, nvme_read_bandwidth=78e9), "nvme_read_bandwidth 7.8e+10 disagrees"),
    (dict(ARRAY, nvme_write_bandwidth=5.5e9), "nvme_write_bandwidth 5.5e+09 disagrees"),
    (dict(nvme_read_bandwidth=7e9), "lacks the field 'nvme_write_bandwidth'"),
    (dict(), "lacks the field 'nvme_read_bandwidth'"),
    (dict(nvme_read_bandwidth=7e9, nvme_write_bandwidth=5e9, cpu_adam_cores=-2),
     "cpu_adam_cores"),
    (dict(nvme_read_bandwidth=7e9, nvme_write_bandwidth=5e9, cpu_adam_cores=8.5),
     "cpu_adam_cores"),
]


@pytest.mark.parametrize("over,needle", BAD)
def test_bad_array_values_are_one_line(over, needle):
    _one_line(_base(**over), needle)


def test_fuzzed_array_fields_load_consistently_or_refuse_in_one_line():
    rng = random.Random(25)
    good = {"nvme_drives": [0, 1, 2, 12], "nvme_drive_read_bandwidth": [0, 6.5e9, 1.0],
            "nvme_drive_write_bandwidth": [0, 3.4e9], "nvme_striping_efficiency": [0.5, 1.0],
            "nvme_read_bandwidth": [0, 7e9, 70.2e9], "nvme_write_bandwidth": [0, 36.72e9, 5e9],
            "cpu_adam_cores": [0, 52]}
    bad = [None, -3, 2.5, -1e9, float("inf"), float("nan"), 1e16, 1.5, True, "x", [], {}]
    keys = list(good)

    def value(k):
        return rng.choice(good[k]) if rng.random() < 0.8 else rng.choice(bad)
    loaded = refused = 0
    for _ in range(400):
        over = {k: value(k) for k in keys if rng.random() < 0.7}
        try:
            s = _load(_base(**over))
        except UserError as e:
            assert "\n" not in str(e) and "t.yaml" in str(e)
            refused += 1
            continue
        loaded += 1
        assert s.nvme_read_bandwidth >= 0 and s.nvme_write_bandwidth >= 0
        if s.nvme_drives:
            eff = 1.0 if s.nvme_drives == 1 else s.nvme_drives * s.nvme_striping_efficiency
            assert s.nvme_read_bandwidth == pytest.approx(s.nvme_drive_read_bandwidth * eff)
        assert _load(s.to_dict()) == s
    assert loaded > 10 and refused > 100


def test_a_measured_tier_figure_replaces_the_array():
    """calibrate writes a measured tier rate: the array it replaces goes, the rest loads."""
    from planner.formats.spec import without_nvme_array
    d = _load(_base(**ARRAY)).to_dict()
    d["nvme_read_bandwidth"] = 50e9                      # measured, below the array's 70.2e9
    with pytest.raises(UserError, match="disagrees"):
        _load(d)
    s = _load(without_nvme_array(d, "calibrated"))
    assert s.nvme_drives == 0 and s.nvme_read_bandwidth == 50e9
    assert s.nvme_write_bandwidth == pytest.approx(12 * 3.4e9 * 0.9)  # the other way kept
    assert "calibrated" in s.sources["nvme_drives"] and "12 drives" in s.sources["nvme_drives"]
    plain = load_hardware("a100-80g").to_dict()
    assert without_nvme_array(plain, "x") == plain


@pytest.mark.parametrize("extra", [0, 1, 10**15])
def test_reserved_bytes_at_or_above_the_devices_memory_is_one_line(extra):
    """A spec reserving all of the device's memory (or more) was loaded, and every solve then
    said "raise --gpu-mem to 909.50 TiB": the spec is now refused naming reserved_bytes."""
    d = _base(nvme_read_bandwidth=7e9, nvme_write_bandwidth=5e9)
    _one_line(dict(d, reserved_bytes=d["memory_bytes"] + extra), "reserved_bytes",
              "is not below memory_bytes", "lower reserved_bytes")
    assert _load(dict(d, reserved_bytes=d["memory_bytes"] - 1)).reserved_bytes > 0
