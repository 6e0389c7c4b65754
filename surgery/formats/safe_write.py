"""Entry points for writing one file safely, and the recovery of what a killed run left.

`atomic_file` and `write_text_atomic` write through surgery.formats.atomic's AtomicGroup;
`recover` (run before every write to a destination) finishes or removes the temp and backup
names a killed run left beside it, and says what it did.
"""

from __future__ import annotations

import os
import stat
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


def _ours(name: str, st: os.stat_result) -> str | None:
    """Why a stale name of our pattern must be left alone, or None when it may be removed.

    Only a regular file this user created, linked once (an attacker's hard link at such a name
    points at a file that is not ours to remove), older than this process.
    """
    if not stat.S_ISREG(st.st_mode) and not stat.S_ISLNK(st.st_mode):
        return "not a regular file"
    if st.st_uid != _EUID:
        return "owned by another user"
    if stat.S_ISREG(st.st_mode) and st.st_nlink != 1:
        return f"{st.st_nlink} names link to it, so another name may be someone's file"
    if st.st_mtime >= _STARTED:
        return "newer than this run"
    return None


def _stale(dest: str, mark: str, notes: list[str]) -> list[tuple[str, os.stat_result]]:
    """Names ``.NAME<mark>PID-HEX`` of `dest` (exactly the layout a run gives them) whose writer
    is gone, each with its lstat; `notes` gets a line for each that must be left alone."""
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
        if pid == os.getpid() or _pid_alive(pid):
            continue  # a writer at work
        out.append((path, st))
    return out


def recover(dests: Sequence[str]) -> list[str]:
    """Clean up after a run killed while writing the group `dests` (last = the index).

    Returns one line per action, for the CLI to show. A temp or backup name is removed only
    when `_ours` allows it (a regular file of this user, linked once, older than this run);
    anything else of our pattern is named in a note and left alone. A destination that a dead
    run replaced under --force (its temp name is a second link of it) gets its backup put back
    when that backup passes `_ours`. A destination is never deleted: shards a dead run published
    without its index are named and left (a forged temp name hard-linked to an existing shard
    would otherwise delete it); the next write with --force replaces them. Unlinking never
    follows a symlink, so a planted one at such a name is removed, not its target.
    """
    notes: list[str] = []
    temps = {d: _stale(d, TEMP_MARK, notes) for d in dests}
    olds = {d: _stale(d, OLD_MARK, notes) for d in dests}
    if not any(temps.values()) and not any(olds.values()):
        return notes

    def by_dead_run(d: str) -> bool:
        try:
            ino = _ino(os.lstat(d))
        except OSError:
            return False
        return any(_ino(st) == ino and stat.S_ISREG(st.st_mode) for _, st in temps[d])

    complete = by_dead_run(dests[-1])
    for d in dests:
        if complete or not by_dead_run(d):
            continue
        backups = [p for p, st in olds[d] if _ours(p, st) is None]
        if not backups:
            notes.append(f"{d}: left alone: an interrupted run may have published it without "
                         "the rest of its group; remove it, or write again with --force")
            continue
        with suppress(OSError):
            os.replace(backups[0], d)
            notes.append(f"{d}: put back the file an interrupted run had replaced")
    for d in dests:
        for p, _ in [*temps[d], *olds[d]]:
            try:
                st = os.lstat(p)  # again: a put-back above changed its links
            except OSError:
                continue
            why = _ours(p, st)
            if why is not None:
                notes.append(f"{p}: left alone ({why}); remove it yourself if it is not needed")
                continue
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
    return notes + [n for n in recover([path]) if n not in notes]


def refuse_inputs(outputs: Sequence[str], inputs: Sequence[str], *, what: str = "input") -> None:
    """Refuse, even with --force, any output that is one of the inputs (by path or by inode).

    Every output a command derives (each shard, the index) is compared with every file it
    reads: a path, a symlink or a hard link to an input is the input. A run never writes a file
    it reads.
    """
    seen: dict[object, str] = {}
    for p in inputs:
        seen[os.path.realpath(p)] = p
        with suppress(OSError):
            seen[_ino(os.stat(p))] = p
    for out in outputs:
        hit = seen.get(os.path.realpath(out))
        if hit is None:
            with suppress(OSError):
                hit = seen.get(_ino(os.stat(out)))
        if hit is not None:
            raise SurgeryError(f"output {out!r} is the {what} {hit!r}, which this run reads",
                               hint="write to another path or folder; an input is never "
                               "overwritten, not even with --force")
