"""Publish output files atomically: all of them or none, never a partial or redirected write.

Every file surgery writes (manifests, safetensors files and shards, their index, cache bundles)
goes through here. The contract:

- **A fresh temp file, never a predictable one.** Each output is written to a new hidden file
  in the destination's folder, ``.NAME.surgery-tmp-PID-RANDOM``, created with
  ``O_CREAT | O_EXCL | O_NOFOLLOW`` relative to a descriptor of the folder. A symlink planted at
  any name cannot redirect the write: ``O_EXCL`` refuses every existing name, symlinks included.
- **No-replace publish.** Without ``force`` a finished temp is published with ``link()`` (or
  ``renameat2(RENAME_NOREPLACE)`` where the file system has no hard links), which fails if the
  destination exists at that instant. So a file that appeared after the run's first check (a
  concurrent export to the same path) is never replaced: exactly one of two racing writers wins
  and the other gets `OutputExistsError` (exit 3). With ``force`` the publish is ``rename()``,
  which replaces atomically: a reader sees the old file or the new one, never a mix.
- **A group is published together or not at all.** Files are published in the order they were
  created (shards first, the index last, so a loader that follows the index never meets a
  missing shard). If any step fails, the files published so far are taken back and, with
  ``force``, the files they replaced are put back: each was kept as a hard link
  ``.NAME.surgery-old-PID-RANDOM`` until the commit ends.
- **Nothing left behind.** Temps are removed on every failure, including KeyboardInterrupt and
  the SIGTERM the CLI turns into one. SIGKILL cannot be handled: a single file is then either
  absent or complete (the publish is one system call), while a group killed in the middle of
  its publish (a few ``link()`` calls, microseconds) can leave some shards without their index.
  `recover` repairs both on the next write to the same destination: until the commit ends, each
  published file keeps its temp name as a second hard link, so the next run can prove which
  files a dead run published. If the group's last file (the index) is among them, the group was
  complete and only the temps go; otherwise the dead run's files are taken back and the files
  they replaced put back. Only names of our own pattern, for those destinations, whose writer
  process is gone and which are older than this process, are touched.

Races closed and not closed:
- Closed: the destination appearing between the existence check at the start of a run and the
  publish at its end (link/renameat2 refuse atomically); a planted symlink at the temp name; a
  temp swapped by someone with write access to the folder between our write and our publish
  (the published inode is compared with the one we wrote, and taken back if it differs).
- Not closed: with ``force``, a file created by someone else in the instant between our backup
  and our rename is replaced (last writer wins; that is what --force asks for). On a file system
  with neither hard links nor renameat2 (some FUSE and network mounts) the no-replace publish
  falls back to check-then-rename, which leaves a window of a few microseconds, and `recover`
  cannot prove what a killed run published there. Readers of a sharded set can see new shards
  before the new index appears; the index is what they follow.
"""

from __future__ import annotations

import ctypes  # lazy: only file systems without hard links get here
import errno
import os
import secrets
from contextlib import suppress
from dataclasses import dataclass, field

from surgery.errors import OutputExistsError, SurgeryError

# The markers in temp names: a new file being written, and a replaced file kept for rollback.
TEMP_MARK = ".surgery-tmp-"
OLD_MARK = ".surgery-old-"

# Destination names are cut to this length inside temp names, so that a long (valid) output
# name never makes its temp name exceed the 255-byte limit of common file systems.
_NAME_KEEP = 120

# errno values that mean "this file system cannot hard-link", not "the name is taken".
_NO_LINK = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS,
            errno.EXDEV}

_EUID = os.geteuid() if hasattr(os, "geteuid") else 0

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_NEW_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
              | getattr(os, "O_CLOEXEC", 0))


def _prefix(dest: str, mark: str) -> str:
    return f".{os.path.basename(dest)[:_NAME_KEEP]}{mark}"


def _fresh(dest: str, mark: str) -> str:
    return f"{_prefix(dest, mark)}{os.getpid()}-{secrets.token_hex(6)}"


def _ino(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


@dataclass
class _Pending:
    dest: str  # the path as given
    folder: int  # descriptor of the destination's folder
    name: str  # basename of the destination
    temp: str  # basename of the temp file
    fd: int
    ino: tuple[int, int]
    published: bool = False
    temp_gone: bool = False  # renamed onto the destination: no temp name to remove
    backup: str | None = None  # with force: a hard link to the file we replaced
    lost: bool = False  # with force, replaced a file we could not keep: rollback cannot undo


@dataclass
class AtomicGroup:
    """Temp files that become real outputs together at `commit`, or vanish.

    Use as a context manager: ``create`` returns a descriptor to write to; leaving the block
    without ``commit()`` (an exception, a signal) removes every temp.
    """

    force: bool = False
    _items: list[_Pending] = field(default_factory=list)
    _folders: dict[str, int] = field(default_factory=dict)
    _done: bool = False

    def __enter__(self) -> AtomicGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._done:
            self._rollback()
        self._close()

    def create(self, dest: str) -> int:
        """A new, exclusive temp file beside `dest`; returns its descriptor (write-only)."""
        folder, name = os.path.split(os.path.abspath(dest))
        if folder not in self._folders:
            self._folders[folder] = os.open(folder, _DIR_FLAGS)
        dfd = self._folders[folder]
        for _ in range(100):
            temp = _fresh(dest, TEMP_MARK)
            try:
                # 0o666 less the umask: the same mode a plain open() would give the output.
                fd = os.open(temp, _NEW_FLAGS, 0o666, dir_fd=dfd)
            except FileExistsError:
                continue  # a name taken (planted, or a collision): draw another
            break
        else:  # pragma: no cover - 100 collisions of 48 random bits
            raise SurgeryError(f"{dest}: cannot create a temporary file beside it",
                               hint="the folder is full of surgery temp files; remove them")
        try:
            self._items.append(_Pending(dest, dfd, name, temp, fd, _ino(os.fstat(fd))))
        except BaseException:
            os.close(fd)
            _unlink_quiet(temp, dfd)
            raise
        return fd

    def commit(self) -> None:
        """fsync every temp, then publish them in creation order; undo all on any failure."""
        try:
            for it in self._items:
                os.fsync(it.fd)
            for it in self._items:
                self._publish(it)
            for dfd in set(self._folders.values()):
                _fsync_dir(dfd)
        except BaseException:
            self._rollback()
            raise
        self._done = True
        # The order matters to `recover`: while the last file's temp name exists, a killed
        # run is known to have published the whole group.
        for it in self._items:
            if it.backup:
                _unlink_quiet(it.backup, it.folder)
        for it in self._items:
            if not it.temp_gone:
                _unlink_quiet(it.temp, it.folder)

    def _publish(self, it: _Pending) -> None:
        if self.force:
            _publish_replace(it)
        else:
            _publish_no_replace(it)
        it.published = True
        if _ino(os.stat(it.name, dir_fd=it.folder, follow_symlinks=False)) != it.ino:
            # Someone replaced our temp between the write and the publish: what we just put
            # in place is theirs, not ours. Take it back (we created that name) and stop.
            if not it.backup:
                _unlink_quiet(it.name, it.folder)
                it.published = False
            raise SurgeryError(f"{it.dest}: the temporary file was replaced by another "
                               "process while writing", hint="write to a folder that only you "
                               "can modify")

    def _rollback(self) -> None:
        for it in reversed(self._items):
            if it.published:
                with suppress(OSError):
                    if it.backup:
                        os.replace(it.backup, it.name, src_dir_fd=it.folder,
                                   dst_dir_fd=it.folder)
                        it.backup = None
                    elif not it.lost and _is(it.name, it.folder, it.ino):
                        _unlink_quiet(it.name, it.folder)  # (else a new file beats none)
                it.published = False
            if not it.temp_gone:
                _unlink_quiet(it.temp, it.folder)
            if it.backup:
                _unlink_quiet(it.backup, it.folder)
        self._done = True

    def _close(self) -> None:
        for it in self._items:
            with suppress(OSError):
                os.close(it.fd)
        self._items = []
        for dfd in self._folders.values():
            os.close(dfd)
        self._folders = {}


def _publish_no_replace(it: _Pending) -> None:
    """Make the temp visible as `it.name`, failing if that name exists at this instant.

    link() keeps the temp name as a second link of the output until the commit ends (see
    `recover`).
    """
    try:
        os.link(it.temp, it.name, src_dir_fd=it.folder, dst_dir_fd=it.folder,
                follow_symlinks=False)
        return
    except FileExistsError:
        raise OutputExistsError(it.dest) from None
    except OSError as e:
        if e.errno not in _NO_LINK:
            raise
    if not _renameat2_noreplace(it):
        # Last resort (no hard links, no renameat2): check, then rename (module docstring).
        if _lexists(it.name, it.folder):
            raise OutputExistsError(it.dest)
        os.rename(it.temp, it.name, src_dir_fd=it.folder, dst_dir_fd=it.folder)
    it.temp_gone = True


def _publish_replace(it: _Pending) -> None:
    """Replace `it.name` atomically, keeping the file it replaces as a backup link."""
    if _lexists(it.name, it.folder):
        backup = _fresh(it.dest, OLD_MARK)
        try:
            os.link(it.name, backup, src_dir_fd=it.folder, dst_dir_fd=it.folder,
                    follow_symlinks=False)
            it.backup = backup
        except OSError:
            it.lost = True  # no hard links here (or a folder): a rollback cannot bring it back
    # rename() consumes its source, so rename a second link and keep the temp name (`recover`).
    second = _fresh(it.dest, TEMP_MARK)
    try:
        os.link(it.temp, second, src_dir_fd=it.folder, dst_dir_fd=it.folder,
                follow_symlinks=False)
    except OSError:
        second = it.temp  # no hard links: rename the temp itself (recover cannot help then)
    try:
        os.replace(second, it.name, src_dir_fd=it.folder, dst_dir_fd=it.folder)
    except BaseException:
        if second != it.temp:
            _unlink_quiet(second, it.folder)
        raise
    it.temp_gone = second == it.temp


def _renameat2_noreplace(it: _Pending) -> bool:
    """renameat2(..., RENAME_NOREPLACE) through libc; False where the call does not exist."""

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    rc = fn(it.folder, os.fsencode(it.temp), it.folder, os.fsencode(it.name), 1)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EEXIST:
        raise OutputExistsError(it.dest)
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), it.dest)


def _is(name: str, dfd: int, ino: tuple[int, int]) -> bool:
    """Whether `name` is still the file `ino` (never take back someone else's file)."""
    try:
        return _ino(os.stat(name, dir_fd=dfd, follow_symlinks=False)) == ino
    except OSError:
        return False


def _lexists(name: str, dfd: int) -> bool:
    try:
        os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _unlink_quiet(name: str, dfd: int) -> None:
    with suppress(OSError):
        os.unlink(name, dir_fd=dfd)


def _fsync_dir(dfd: int) -> None:
    with suppress(OSError):  # some file systems cannot fsync a folder; the files are synced
        os.fsync(dfd)


# --- what a killed run left ---------------------------------------------------------------------
