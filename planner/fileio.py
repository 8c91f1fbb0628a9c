"""Reading and writing the files tierplan owns: atomic writes, bounded JSON reads, digests.

Every write goes to a temporary file in the target's folder and is renamed over the target,
so a reader never sees half a file and a failure leaves what was there. Every read turns a
problem with the user's file into one ``UserError`` line (exit 2) that names the file.
This module imports neither torch nor pulp.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .errors import UserError


def write_atomic(path: str | os.PathLike, write, binary: bool = False) -> Path:
    """Call ``write(f)`` on a temporary file in the target's folder, then rename it over the
    target.

    A reader never sees a half-written file, and an existing file is replaced only once the new
    one is complete; on any failure (Ctrl-C included) the temporary file is removed.
    """
    path = Path(path)
    if path.is_dir():
        raise UserError(f"output '{path}' is a directory; give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise UserError(f"output '{path}': cannot create it ({e.strerror}); give a path in a "
                        "writable folder") from None
    try:
        # mkstemp creates 0600 files; give the output the permissions a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """Write ``obj`` as sorted JSON atomically (see ``write_atomic``)."""
    def write(f):
        json.dump(obj, f, sort_keys=True, indent=1)
        f.write("\n")
    return write_atomic(path, write)


def read_json(path: str | os.PathLike, what: str) -> dict:
    """Read a JSON object, turning every failure into one UserError line."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{what} '{path}': no such file; check the path")
    if p.is_dir():
        raise UserError(f"{what} '{path}' is a directory; give a JSON file")
    try:
        text = p.read_text()
    except OSError as e:
        raise UserError(f"{what} '{path}': cannot read it ({e.strerror}); check its permissions")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{what} '{path}' is not valid JSON (line {e.lineno}: {e.msg}); "
                        "regenerate it with the plan tool")
    if not isinstance(obj, dict):
        raise UserError(f"{what} '{path}' is not a JSON object; regenerate it with the plan tool")
    return obj


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
