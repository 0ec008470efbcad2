"""Reading JSON that someone else wrote (plan files, cluster files) without trusting it.

A file named by the user may be a symlink to ``/dev/zero``, a FIFO nobody writes to, a directory, gigabytes long,
binary, or JSON nested ten thousand deep; each of these is refused with one sentence naming the path, before much is
read. Opening uses ``O_NONBLOCK`` (a FIFO would otherwise block the open itself) and the kind of file is checked on
the open descriptor (``fstat``), so a path swapped between the check and the read cannot slip through. Numbers that
JSON cannot hold as finite floats (``1e400``, ``NaN``, ``Infinity``) are refused too: every later ``int()`` or
comparison would fail with an OverflowError far from the file.

    >>> loads_json('{"a": [1, 2.5]}', "example")
    {'a': [1, 2.5]}
    >>> loads_json('{"a": 1e400}', "example")
    Traceback (most recent call last):
    ValueError: example holds a number JSON cannot represent as a finite value ('1e400'); write a finite number.
"""

from __future__ import annotations

import json
import math
import os
import stat

__all__ = ["MAX_JSON_BYTES", "MAX_JSON_DEPTH", "read_text_file", "loads_json", "read_json_file", "json_depth",
           "write_atomic", "probe_writable"]

#: Plan files of the deepest zoo models are a few MiB (one strategy name per operator); 64 MiB leaves room.
MAX_JSON_BYTES = 64 * 2**20
#: Plan and cluster files nest a handful of levels; anything this deep is not one of ours.
MAX_JSON_DEPTH = 32


def read_text_file(path, what: str, limit: int = MAX_JSON_BYTES) -> str:
    """The text of a regular file of at most ``limit`` bytes, decoded as UTF-8; ValueError (with the path) otherwise.

    ``what`` names the file in messages ("plan file", "cluster file").
    """
    name = os.fspath(path)
    where = f"{what} {name!r}"
    try:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ValueError(f"cannot read {where} ({e.strerror or e}).") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise ValueError(f"{where} is a directory; give the path of a JSON file.")
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{where} is not a regular file (a device, FIFO or socket); give the path of a JSON "
                             "file.")
        if info.st_size > limit:
            raise ValueError(f"{where} is {info.st_size:,} bytes, more than the {limit:,} a {what} may have.")
        os.set_blocking(fd, True)
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:  # it grew while we read
                raise ValueError(f"{where} is more than the {limit:,} bytes a {what} may have.")
    except OSError as e:
        raise ValueError(f"cannot read {where} ({e.strerror or e}).") from None
    finally:
        os.close(fd)
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not text (byte {e.start} is not UTF-8); give the path of a JSON file.") from None


def _finite(text: str, where: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{where} holds a number JSON cannot represent as a finite value ({text!r}); write a finite "
                         "number.")
    return value


def json_depth(text: str) -> int:
    """How deep ``text``'s brackets nest (strings skipped), counted without parsing: a bound checked before json
    recurses."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def loads_json(text: str, where: str, max_depth: int = MAX_JSON_DEPTH):
    """``json.loads`` for untrusted text: finite numbers only, nesting at most ``max_depth``; ValueError naming
    ``where`` otherwise."""
    if json_depth(text) > max_depth:
        raise ValueError(f"{where} nests deeper than {max_depth} levels; it is not a file autopar-lab wrote.")

    def constant(name):
        raise ValueError(f"{where} holds a number JSON cannot represent as a finite value ({name!r}); write a finite "
                         "number.")

    try:
        return json.loads(text, parse_float=lambda s: _finite(s, where), parse_constant=constant)
    except ValueError as e:
        if where in str(e):
            raise
        raise ValueError(f"{where} is not valid JSON ({e}).") from None
    except RecursionError:
        raise ValueError(f"{where} nests too deeply; it is not a file autopar-lab wrote.") from None


def read_json_file(path, what: str, limit: int = MAX_JSON_BYTES):
    """:func:`read_text_file` then :func:`loads_json`."""
    return loads_json(read_text_file(path, what, limit), f"{what} {os.fspath(path)!r}")


def probe_writable(folder) -> None:
    """Raise OSError unless a file can be created in ``folder``: one is made and removed. Asking ``os.access`` is not
    enough (root passes it everywhere, a read-only file system does not show in the mode bits)."""
    import tempfile

    fd, probe = tempfile.mkstemp(prefix=".autopar-probe-", dir=os.fspath(folder))
    os.close(fd)
    os.unlink(probe)


def write_atomic(path, data) -> None:
    """Write ``data`` (bytes, or a function given the open binary file) to ``path`` all at once: into a temporary
    file beside it, synced, then renamed over ``path``. A crash or kill at any moment leaves either the old file or
    the new one, never a torn one; a temporary file of a killed writer is left behind, never read as the real one.
    """
    import tempfile

    target = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(target))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=folder)
    try:
        try:  # mkstemp makes it 0600: keep the mode the file had, or the usual 0644 for a new one
            os.fchmod(fd, stat.S_IMODE(os.stat(target).st_mode))
        except OSError:
            os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # the rename itself survives a power cut only once the folder is synced
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
