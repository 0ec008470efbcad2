"""Reading JSON that someone else wrote (plan files, cluster files) without trusting it, and writing files whole.

A file named by the user may be a symlink to ``/dev/zero``, a FIFO nobody writes to, a directory, gigabytes long,
binary, or JSON nested ten thousand deep; each of these is refused with one sentence naming the path, before much is
read. Opening uses ``O_NONBLOCK`` (a FIFO would otherwise block the open itself) and the kind of file is checked on
the open descriptor (``fstat``), so a path swapped between the check and the read cannot slip through. Numbers that
JSON cannot hold as finite floats (``1e400``, ``NaN``, ``Infinity``) are refused too: every later ``int()`` or
comparison would fail with an OverflowError far from the file; so are integers past Python's limit on digits.

Writing (:func:`write_atomic`) replaces a regular file or creates one, never anything else at the path: a device, a
FIFO, a symlink or a directory is refused with one sentence, as the reader refuses them.

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

__all__ = ["MAX_JSON_BYTES", "MAX_JSON_DEPTH", "open_regular", "read_text_file", "loads_json", "read_json_file",
           "json_depth", "write_atomic", "check_write_target", "probe_writable"]

#: Plan files of the deepest zoo models are a few MiB (one strategy name per operator); 64 MiB leaves room.
MAX_JSON_BYTES = 64 * 2**20
#: Plan and cluster files nest a handful of levels; anything this deep is not one of ours.
MAX_JSON_DEPTH = 32


def open_regular(path, what: str, hint: str = "give the path of a file"):
    """An open binary file of the regular file at ``path`` (symlinks followed); ValueError naming it (as ``what``)
    and ending with ``hint`` otherwise.

    The kind of file is checked on the open descriptor, so a path swapped between a check and the read cannot slip
    through; opening never blocks (``O_NONBLOCK``: a FIFO nobody writes to would block the open itself).
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
            raise ValueError(f"{where} is a directory; {hint}.")
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{where} is not a regular file (a device, FIFO or socket); {hint}.")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_text_file(path, what: str, limit: int = MAX_JSON_BYTES, hint: str = "give the path of a JSON file") -> str:
    """The text of a regular file of at most ``limit`` bytes, decoded as UTF-8; ValueError (with the path) otherwise.

    ``what`` names the file in messages ("plan file", "cluster file"); ``hint`` says what to do about a file that is
    not one.
    """
    where = f"{what} {os.fspath(path)!r}"
    chunks, total = [], 0
    with open_regular(path, what, hint) as f:
        try:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise ValueError(f"{where} is {size:,} bytes, more than the {limit:,} a {what} may have.")
            while True:
                chunk = f.read(min(1 << 20, limit + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
                if total > limit:  # it grew while we read
                    raise ValueError(f"{where} is more than the {limit:,} bytes a {what} may have.")
        except OSError as e:
            raise ValueError(f"cannot read {where} ({e.strerror or e}).") from None
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not text (byte {e.start} is not UTF-8); {hint}.") from None


def _number_text(text: str) -> str:
    """A number as messages show it: itself, or its length when it is too long to read."""
    return repr(text) if len(text) <= 40 else f"a number of {len(text):,} characters"


def _finite(text: str, where: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{where} holds a number JSON cannot represent as a finite value ({_number_text(text)}); "
                         "write a finite number.")
    return value


def _whole(text: str, where: str) -> int:
    try:
        return int(text)
    except ValueError:  # past Python's limit on digits converted (4300): no setting is that large
        raise ValueError(f"{where} holds a number too large to be any setting ({len(text.lstrip('-')):,} digits); "
                         "write a smaller number.") from None


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
        return json.loads(text, parse_float=lambda s: _finite(s, where), parse_int=lambda s: _whole(s, where),
                          parse_constant=constant)
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


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))


def check_write_target(path, what: str = "file") -> None:
    """Raise ValueError unless ``path`` is free or a regular file: what :func:`write_atomic` may replace.

    A rename replaces whatever has the name: a device (``/dev/null`` as root), a FIFO, a symlink (the link, not its
    target) or an empty directory would become a regular file. The symlink itself is refused too: writing through it
    would change a file somewhere else, replacing it would break the link.
    """
    name = os.fspath(path)
    try:
        mode = os.lstat(name).st_mode
    except OSError:  # nothing there (or a folder that is not one): the write itself says what is wrong
        return
    if not stat.S_ISREG(mode):
        kind = next((k for test, k in _KINDS if test(mode)), "not a file")
        raise ValueError(f"cannot write {what} {name!r}: it is {kind}, not a regular file; pick a regular file "
                         "path.")


def write_atomic(path, data, what: str = "file") -> None:
    """Write ``data`` (bytes, or a function given the open binary file) to ``path`` all at once: into a temporary
    file beside it, synced, then renamed over ``path``. A crash or kill at any moment leaves either the old file or
    the new one, never a torn one; a temporary file of a killed writer is left behind, never read as the real one.

    Only a regular file is replaced (:func:`check_write_target`, ValueError naming ``path`` as ``what``); it keeps its
    mode.
    """
    import tempfile

    target = os.fspath(path)
    check_write_target(target, what)
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
        check_write_target(target, what)  # again: something may have taken the name while we wrote
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
