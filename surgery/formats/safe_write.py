"""Entry points for writing one file safely, and the recovery of what a killed run left.

`atomic_file` and `write_text_atomic` write through surgery.formats.atomic's AtomicGroup;
`recover` (run before every write to a destination) finishes or removes the temp and backup
names a killed run left beside it, and says what it did.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress

from surgery.errors import OutputExistsError, SurgeryError
from surgery.formats.atomic import _EUID, OLD_MARK, TEMP_MARK, AtomicGroup, _ino, _prefix

_STARTED = time.time()  # names of our pattern last modified before this may be stale


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except (OverflowError, ValueError):
        return False
    return True


def _stale(dest: str, mark: str) -> list[tuple[str, os.stat_result]]:
    """Names ``.NAME<mark>PID-HEX`` of `dest` whose writer is gone and that predate this run."""
    folder = os.path.dirname(os.path.abspath(dest))
    prefix = _prefix(dest, mark)
    out: list[tuple[str, os.stat_result]] = []
    try:
        names = [n for n in os.listdir(folder) if n.startswith(prefix)]
    except OSError:
        return out
    for n in names:
        pid_text, _, tail = n[len(prefix):].partition("-")
        if not (pid_text.isdigit() and len(tail) == 12
                and all(c in "0123456789abcdef" for c in tail)):
            continue
        pid = int(pid_text)
        path = os.path.join(folder, n)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        # Our own names only: made by this user (an attacker's hard link at such a name must
        # not make us remove the file it points to), by a process that is gone, before us.
        if (st.st_uid == _EUID and pid != os.getpid() and not _pid_alive(pid)
                and st.st_mtime < _STARTED):
            out.append((path, st))
    return out


def recover(dests: Sequence[str]) -> list[str]:
    """Clean up after a run killed while writing the group `dests` (last = the index).

    Returns one line per action, for the CLI to show. See the module docstring for how a
    dead run's published files are proven to be its own, and why only they are taken back.
    Unlinking never follows a symlink, so a planted one at such a name is removed, not its
    target.
    """
    notes: list[str] = []
    temps = {d: _stale(d, TEMP_MARK) for d in dests}
    olds = {d: _stale(d, OLD_MARK) for d in dests}
    if not any(temps.values()) and not any(olds.values()):
        return notes

    def by_dead_run(d: str) -> bool:
        try:
            ino = _ino(os.lstat(d))
        except OSError:
            return False
        return any(_ino(st) == ino and not os.path.islink(p) for p, st in temps[d])

    complete = by_dead_run(dests[-1])
    for d in dests:
        if complete or not by_dead_run(d):
            continue
        backups = [p for p, _ in olds[d]]
        try:
            if backups:
                os.replace(backups[0], d)
                notes.append(f"{d}: put back the file an interrupted run had replaced")
            else:
                os.unlink(d)
                notes.append(f"{d}: removed, an interrupted run published it without the "
                             "rest of its group")
        except OSError:
            continue
    for d in dests:
        for p, _ in [*temps[d], *olds[d]]:
            with suppress(OSError):
                os.unlink(p)
                notes.append(f"{p}: removed, a temporary file an interrupted run left")
    return notes


@contextmanager
def atomic_file(dest: str, *, force: bool = False) -> Iterator[int]:
    """One output file: yields a descriptor; published when the block ends without error."""
    with AtomicGroup(force=force) as group:
        fd = group.create(dest)
        yield fd
        group.commit()


def write_all(fd: int, data: bytes | memoryview) -> None:
    """os.write until every byte is written (a write may be short)."""
    view = memoryview(data)
    while view.nbytes:
        n = os.write(fd, view)
        view = view[n:]


def write_text_atomic(path: str, text: str | bytes, *, force: bool = False) -> list[str]:
    """Write `text` to `path` atomically (see the module docstring); returns `recover`'s notes.

    Refuses an existing `path` unless `force`, both before writing and at the publish, so a file
    that appears meanwhile is not replaced either.
    """
    notes = recover([path])
    if not force and os.path.lexists(path):
        raise OutputExistsError(path)
    data = text.encode("utf-8") if isinstance(text, str) else text
    try:
        with atomic_file(path, force=force) as fd:
            write_all(fd, data)
    except OSError as e:
        raise SurgeryError(f"{path}: cannot write: {e.strerror or e}",
                           hint="check the folder exists, is writable and has room") from None
    return notes
