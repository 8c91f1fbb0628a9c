"""Hardware specs: the shipped sheets in ``profiles/hardware/`` and user YAML files.

Measuring this host (``plan hardware``) lives in ``planner.hardware.measure``; the spec's
dataclass and its validation in ``planner.formats.spec``. YAML is read the way
every input is (``planner.formats.fileio``: a regular file, bounded, strict UTF-8), as plain data:
no tags, no anchors or aliases (a few nested aliases expand to billions of nodes when the
spec is copied), nesting bounded.
"""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from planner import PROFILES_DIR
from planner.errors import UserError
from planner.formats.fileio import _shown, check_depth, read_text
from planner.formats import HardwareSpec

HARDWARE_DIR = PROFILES_DIR / "hardware"
# A shipped spec's name: letters, digits, '.', '_' and '-' (anything else is a file path).
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def shipped_names() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def load_hardware(name_or_file: str) -> HardwareSpec:
    """Resolve ``a100-80g`` (a shipped sheet) or ``path/to/spec.yaml`` into a HardwareSpec."""
    s = str(name_or_file)
    if _NAME.match(s) and s in shipped_names():
        source = HARDWARE_DIR / f"{s}.yaml"
    elif _NAME.match(s) and not s.endswith((".yaml", ".yml", ".json")):
        raise UserError(f"--hardware '{s}': no such spec; use one of "
                        f"{', '.join(shipped_names())} or a YAML file")
    else:
        source = Path(s)
    data = read_yaml_mapping(source, "hardware spec", "profiles/hardware/*.yaml",
                             label=f"--hardware '{_shown(s)}'",
                             names=f", or use one of {', '.join(shipped_names())}")
    return HardwareSpec.from_dict(data, _shown(source))


class _PlainLoader(yaml.SafeLoader):
    """SafeLoader without aliases: a spec or a model config never needs them."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            ev = self.peek_event()
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed",
                                              ev.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        """A key given twice in one mapping is refused (PyYAML keeps the last one silently);
        a merge (``<<``) may still be overridden by the mapping's own keys."""
        seen: set = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {str(key)[:80]!r} given twice",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml_mapping(source: Path, what: str, example: str, label: str | None = None,
                      names: str = "") -> dict:
    """A YAML file that must hold a mapping; every failure is one UserError line (``label``
    names the argument in 'no such file', followed by ``names``, the alternatives)."""
    where = f"{what} '{_shown(source)}'"
    try:
        text = read_text(source, what)
    except UserError as e:
        if label and "no such file" in str(e):
            raise UserError(f"{label}: no such file; check the path{names}") from None
        raise
    try:
        data = yaml.load(text, Loader=_PlainLoader)   # noqa: S506 -- a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise UserError(f"{where} cannot be read as YAML ({problem}{at}); fix the file or "
                        f"start from {example}") from None
    except RecursionError:
        raise UserError(f"{where} nests too deeply to read; fix the file or start from "
                        f"{example}") from None
    if not isinstance(data, dict):
        raise UserError(f"{where} is not a mapping; see {example}")
    check_depth(data, where, f"fix the file or start from {example}")
    return data
