"""Hardware specs: the shipped sheets in ``profiles/hardware/`` and user YAML files.

Measuring this host (``plan hardware``) lives in ``planner.measure``.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from . import PROFILES_DIR
from .errors import UserError
from .formats import HardwareSpec

HARDWARE_DIR = PROFILES_DIR / "hardware"


def shipped_names() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def load_hardware(name_or_file: str) -> HardwareSpec:
    """Resolve ``a100-80g`` (a shipped sheet) or ``path/to/spec.yaml`` into a HardwareSpec."""
    p = Path(name_or_file)
    if p.suffix in (".yaml", ".yml", ".json") or p.exists():
        source = p
    else:
        source = HARDWARE_DIR / f"{name_or_file}.yaml"
        if not source.exists():
            raise UserError(f"--hardware '{name_or_file}': no such spec; use one of "
                            f"{', '.join(shipped_names())} or a YAML file")
    if not source.exists():
        raise UserError(f"--hardware '{name_or_file}': no such file; check the path")
    data = read_yaml_mapping(source, "hardware spec", "profiles/hardware/*.yaml")
    return HardwareSpec.from_dict(data, str(source))


def read_yaml_mapping(source: Path, what: str, example: str) -> dict:
    """A YAML file that must hold a mapping; every failure is one UserError line."""
    try:
        data = yaml.safe_load(source.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"{what} '{source}' cannot be read as YAML ({type(e).__name__}); "
                        f"fix the file or start from {example}")
    if not isinstance(data, dict):
        raise UserError(f"{what} '{source}' is not a mapping; see {example}")
    return data
