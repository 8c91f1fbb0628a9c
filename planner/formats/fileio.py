"""Reading and writing the files tierplan owns: bounded strict reads, safe atomic writes, digests.

Reads accept regular files only (a FIFO would block for ever, ``/dev/zero`` never ends), at
most ``MAX_INPUT_BYTES``, strict UTF-8, and JSON without ``NaN``/``Infinity``, nested at most
``MAX_DEPTH`` deep; every problem becomes one ``UserError`` line (exit 2) naming the file.

Writes go to a temporary file in the target's folder, are flushed to disk and renamed over
the target, so a reader never sees half a file and a failure (Ctrl-C, SIGTERM) leaves what
was there. An output may only be a regular file or a new name: a directory, a device, a FIFO
or a socket is refused, and so is a file the command is reading (``-o`` naming the input
profile). Missing folders are created only where ``docs/reliability.md`` says so: the
output's own folder, one level, when its parent exists (``make_parents=True``, the CLI's
outputs); nothing deeper, so a mistyped path does not grow a tree of folders.

This module imports neither torch nor pulp.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import re
import stat
import tempfile
import unicodedata
from pathlib import Path
from typing import Any, Iterable

from planner.errors import CAUGHT_SIGNALS, UserError

# The largest file a loader reads. A 10,000-unit plan is ~60 MB of JSON; 256 MiB leaves room
# while bounding memory (json.loads takes ~10x the text size in objects).
MAX_INPUT_BYTES = 256 * 1024**2
# The deepest nesting of lists and objects a file may have. Ours need 6 (a plan's model
# section: params -> unit -> entry -> shape); 64 is generous and far below the recursion
# limit of the code that walks them.
MAX_DEPTH = 64
# A path longer than this (in bytes) is refused before the OS is asked (PATH_MAX is 4096).
MAX_PATH_BYTES = 4096
# The longest name of one folder or file the OS takes (NAME_MAX).
MAX_NAME_BYTES = 255


def _shown(path) -> str:
    """A path as it appears in a one-line message: control characters escaped, long ones cut."""
    s = str(path)
    s = s.encode("utf-8", "backslashreplace").decode("utf-8") if _has_surrogates(s) else s
    s = "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)
    return s if len(s) <= 200 else s[:120] + "..." + s[-60:]


def _has_surrogates(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _check_path_text(path, what: str) -> None:
    s = os.fspath(path)
    if isinstance(s, bytes):
        s = os.fsdecode(s)
    if not s:
        raise UserError(f"{what}: the path is empty; give a file name")
    if "\x00" in s:
        raise UserError(f"{what} '{_shown(s)}': the path contains a NUL byte; give a valid path")
    if len(os.fsencode(s)) > MAX_PATH_BYTES:
        raise UserError(f"{what} '{_shown(s)}': the path is {len(os.fsencode(s))} bytes long, "
                        f"more than {MAX_PATH_BYTES}; give a shorter path")


def path_problem(path) -> str | None:
    """Why ``path`` cannot name a directory tierplan keeps and prints (``nvme_dir``), or
    None: empty, a control character (a newline would split every line that shows it), more
    than the OS takes (PATH_MAX 4096 bytes with its terminating NUL, NAME_MAX 255 bytes a
    component)."""
    s = os.fsdecode(path) if isinstance(path, bytes) else str(path)
    if not s:
        return "the path is empty"
    bad = next((c for c in s if unicodedata.category(c) in ("Cc", "Zl", "Zp")), None)
    if bad is not None:
        return f"the path contains the control character {ascii(bad)}"
    n = _nbytes(s)
    if n >= MAX_PATH_BYTES:
        return (f"the path is {n} bytes long; the OS takes at most {MAX_PATH_BYTES - 1} "
                "(PATH_MAX)")
    for part in s.split("/"):
        m = _nbytes(part)
        if m > MAX_NAME_BYTES:
            return (f"one of its names is {m} bytes long; the OS takes at most "
                    f"{MAX_NAME_BYTES} a name (NAME_MAX)")
    return None


def _nbytes(s: str) -> int:
    """The length of ``s`` as the OS gets it."""
    try:
        return len(os.fsencode(s))
    except UnicodeEncodeError:
        return len(s.encode("utf-8", "surrogatepass"))


def _os_reason(e: OSError) -> str:
    return e.strerror or type(e).__name__


def _is_dir(p) -> bool:
    """``Path.is_dir`` that says False for every error (it raises on ENAMETOOLONG)."""
    try:
        return stat.S_ISDIR(os.stat(p).st_mode)
    except (OSError, ValueError):
        return False


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


# ----------------------------------------------------------------------------- reading

def read_bytes(path: str | os.PathLike, what: str, limit: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes, or one UserError line."""
    _check_path_text(path, what)
    shown = _shown(path)
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise UserError(f"{what} '{shown}': no such file; check the path") from None
        raise UserError(f"{what} '{shown}': cannot read it ({_os_reason(e)}); check the "
                        "path and its permissions") from None
    if stat.S_ISDIR(st.st_mode):
        raise UserError(f"{what} '{shown}' is a directory; give a file")
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{what} '{shown}' is {_kind(st.st_mode)}, not a regular file; give "
                        "a file")
    try:
        # O_NONBLOCK: should the name become a FIFO between stat and open, open does not block
        # (and fstat below refuses it).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise UserError(f"{what} '{shown}': cannot read it ({_os_reason(e)}); check its "
                        "permissions") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{what} '{shown}' is {_kind(st.st_mode)}, not a regular file; "
                            "give a file")
        if st.st_size > limit:
            raise UserError(f"{what} '{shown}' is {st.st_size} bytes, more than the "
                            f"{limit} this tool reads; give the file it wrote")
        chunks, n = [], 0
        while True:                       # never more than limit + 1 bytes, even if it grows
            b = os.read(fd, min(1 << 20, limit + 1 - n))
            if not b:
                break
            chunks.append(b)
            n += len(b)
            if n > limit:
                raise UserError(f"{what} '{shown}' is more than the {limit} bytes this tool "
                                "reads; give the file it wrote")
        return b"".join(chunks)
    except OSError as e:
        raise UserError(f"{what} '{shown}': cannot read it ({_os_reason(e)}); check the "
                        "file") from None
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike, what: str, limit: int = MAX_INPUT_BYTES) -> str:
    """A regular file's text, strict UTF-8 (a leading byte-order mark is dropped)."""
    data = read_bytes(path, what, limit)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise UserError(f"{what} '{_shown(path)}' is not UTF-8 text (byte {e.start}, line "
                        f"{line}); give the file the plan tool wrote") from None
    return text[1:] if text.startswith("\ufeff") else text


_FIXES = {"profile": "regenerate it with 'plan profile'", "plan": "regenerate it with 'plan solve'",
          "report": "save it again with handle.report().save(path)"}
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _find_nonfinite(obj) -> tuple[str, float] | None:
    """Where the first NaN or infinity sits, as people name it (``unit 'blocks.0': fwd_s``)."""
    stack = [(obj, "")]
    while stack:
        o, where = stack.pop()
        if isinstance(o, float) and not math.isfinite(o):
            return where or "the top level", o
        if isinstance(o, dict):
            for k, v in reversed(list(o.items())):
                stack.append((v, f"{where}: {k}" if where.endswith("'") else
                              (f"{where}.{k}" if where else str(k))))
        elif isinstance(o, list):
            for i, v in reversed(list(enumerate(o))):
                label = f"{where}[{i}]"
                if isinstance(v, dict):
                    name = v.get("name") if isinstance(v.get("name"), str) else v.get("id")
                    if isinstance(name, str):
                        noun = {"layers": "unit", "units": "unit"}.get(where.rsplit(".", 1)[-1],
                                                                        "entry")
                        if where.startswith("schedule"):
                            noun = "schedule event"
                        label = f"{noun} {name!r}"
                stack.append((v, label))
    return None


def check_depth(obj, where: str, fix: str) -> None:
    """Refuse nesting deeper than MAX_DEPTH (iteratively: no recursion to exhaust)."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            items = o.values()
        elif isinstance(o, list):
            items = o
        else:
            continue
        if d > MAX_DEPTH:
            raise UserError(f"{where} nests lists or objects more than {MAX_DEPTH} deep; {fix}")
        stack.extend((x, d + 1) for x in items if isinstance(x, (dict, list)))


# A JSON string escape of a UTF-16 surrogate: valid only in high-low pairs.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _check_strings(obj, where: str, fix: str) -> None:
    """Refuse lone surrogates (``"\\ud800"``): Python accepts them, but no UTF-8 output can
    print them, so a name holding one would crash the first print."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, str):
            if _has_surrogates(o):
                raise UserError(f"{where} holds a string with a lone UTF-16 surrogate "
                                f"({_shown(o)[:60]}); {fix}")
        elif isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)


class _DuplicateKey(Exception):
    """A key given twice in one JSON object (``args[0]``), raised out of ``json.loads``."""


def _no_duplicates(pairs: list) -> dict:
    """An object's members as a dict; a key given twice raises (``json`` keeps the last one
    silently, so an edit that adds a field beside the old one would load either)."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return d


def parse_json_text(text: str, where: str, fix: str) -> Any:
    """Strict JSON: no NaN/Infinity (refused naming the field that holds one), no key twice
    in one object, bounded depth, no lone surrogates."""
    seen = []

    def constant(name):
        seen.append(name)
        return _NONFINITE[name]
    try:
        obj = json.loads(text, parse_constant=constant, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as e:
        raise UserError(f"{where} gives the key {_shown(e.args[0])[:80]!r} twice in one "
                        f"object (which one counts is ambiguous); remove one, or {fix}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{where} is not valid JSON (line {e.lineno} column {e.colno}: "
                        f"{e.msg}); {fix}") from None
    except RecursionError:
        raise UserError(f"{where} nests lists or objects too deeply to read; {fix}") from None
    except ValueError as e:     # huge integers (Python's limit on digits)
        msg = str(e).splitlines()[0][:120]
        raise UserError(f"{where} is not valid JSON ({msg}); {fix}") from None
    check_depth(obj, where, fix)
    if seen:
        at = _find_nonfinite(obj)
        loc, val = at if at else ("a number", math.nan)
        name = "NaN" if math.isnan(val) else ("Infinity" if val > 0 else "-Infinity")
        raise UserError(f"{where}: {loc} is {name}, which JSON does not allow (numbers "
                        f"must be finite); {fix}")
    if _SURROGATE_ESCAPE.search(text):
        _check_strings(obj, where, fix)
    return obj


def read_json(path: str | os.PathLike, what: str) -> dict:
    """Read a JSON object, turning every failure into one UserError line."""
    text = read_text(path, what)
    where = f"{what} '{_shown(path)}'"
    obj = parse_json_text(text, where, _FIXES.get(what.split()[0], "regenerate it with the "
                                                                  "plan tool"))
    if not isinstance(obj, dict):
        raise UserError(f"{where} is not a JSON object; regenerate it with the plan tool")
    return obj


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------- writing

def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def check_output(path: str | os.PathLike, *, inputs: Iterable = (), what: str = "output",
                 make_parents: bool = False) -> Path:
    """Refuse an output path that must not be written: one UserError line naming it.

    Refused: an empty or over-long path, a directory, anything not a regular file (devices,
    FIFOs, sockets, also through a symbolic link), a file among ``inputs`` (the command's own
    input), a missing folder (unless ``make_parents`` and only the last folder is missing)
    and a folder that is not one. Checked before any work, so that a long command does not
    fail at its end; ``write_atomic`` checks again when it writes."""
    _check_path_text(path, what)
    p = Path(path)
    shown = _shown(path)
    st = _stat_or_none(p, what, shown, "it")
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise UserError(f"{what} '{shown}' is a directory; give a file name")
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{what} '{shown}' is {_kind(st.st_mode)}; refusing to replace it "
                            "with a file: give a regular file name")
        for src in inputs:
            if src is None:
                continue
            with contextlib.suppress(OSError, ValueError):
                if _same_file(st, os.stat(src)):
                    raise UserError(f"{what} '{shown}' is the command's input '{_shown(src)}'; "
                                    "refusing to overwrite it: give another file name")
        return p
    parent = p.parent
    pst = _stat_or_none(parent, what, shown, "its folder")
    if pst is None:
        grand = parent.parent
        if make_parents and _is_dir(grand):
            return p
        raise UserError(f"{what} '{shown}': its folder '{_shown(parent)}' does not exist; "
                        "create it first or give a path in an existing folder")
    if not stat.S_ISDIR(pst.st_mode):
        raise UserError(f"{what} '{shown}': cannot create it ('{_shown(parent)}' is not a "
                        "folder); give a path in an existing folder")
    return p


def write_atomic(path: str | os.PathLike, write, binary: bool = False, *, inputs: Iterable = (),
                 make_parents: bool = True, what: str = "output") -> Path:
    """Call ``write(f)`` on a temporary file in the target's folder, then rename it over the
    target.

    A reader never sees a half-written file, and an existing file is replaced only once the new
    one is complete and on disk; on any failure (Ctrl-C or SIGTERM included) the temporary file
    is removed. The target is checked by ``check_output`` (``inputs`` are the command's input
    files, never overwritten); ``make_parents`` creates the target's own folder, one level,
    where its parent exists.
    """
    inputs = tuple(inputs)
    path = check_output(path, inputs=inputs, what=what, make_parents=make_parents)
    shown = _shown(path)
    made = None
    try:
        if not _is_dir(path.parent):
            with contextlib.suppress(FileExistsError):   # another process made it meanwhile
                path.parent.mkdir()      # one level; check_output refused anything deeper
                made = path.parent
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:80]}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        if made is not None:
            with contextlib.suppress(OSError):
                made.rmdir()
        raise UserError(f"{what} '{shown}': cannot create it ({_os_reason(e)}); give a path "
                        "in a writable folder") from None
    try:
        # mkstemp creates 0600 files; give the output the permissions a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        # Checked again just before the rename: the target may have become a device or an
        # input since the first check (the rename itself replaces only the name).
        check_output(path, inputs=inputs, what=what)
        if CAUGHT_SIGNALS:     # a signal swallowed on its way up: the command is ending
            raise CAUGHT_SIGNALS[0]
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if made is not None:
            with contextlib.suppress(OSError):
                made.rmdir()
        if isinstance(e, OSError) and not isinstance(e, UserError):
            raise UserError(f"{what} '{shown}': cannot write it ({_os_reason(e)}); give a path "
                            "on a writable disk with room") from None
        raise
    with contextlib.suppress(OSError):    # the rename is durable once the folder is synced
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return path


def write_json_atomic(path: str | os.PathLike, obj: Any, *, inputs: Iterable = (),
                      make_parents: bool = True, what: str = "output") -> Path:
    """Write ``obj`` as sorted JSON atomically (see ``write_atomic``)."""
    def write(f):
        json.dump(obj, f, sort_keys=True, indent=1, allow_nan=False)
        f.write("\n")
    return write_atomic(path, write, inputs=inputs, make_parents=make_parents, what=what)


def lock_dir(path: str | os.PathLike) -> int | None:
    """An exclusive ``flock`` on directory ``path`` without waiting: its fd (the lock lives as
    long as it is open), or None if another process holds it or the directory is gone. Solve
    directories and the runtime's NVMe directories are locked by their process this way, so a
    sweep can tell a dead owner's directory from a live one's."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _stat_or_none(path, what: str, shown: str, of: str):
    """``os.stat(path)`` for an output named ``shown``, or None where nothing is there yet;
    any other failure is one line (``of``: what of the output was looked at)."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ENOTDIR:
            raise UserError(f"{what} '{shown}': cannot create it (a folder on its path is a "
                            "file); give a path in an existing folder") from None
        raise UserError(f"{what} '{shown}': cannot use {of} ({_os_reason(e)}); give another "
                        "path") from None
