"""The folders a verified bundle's code goes into must be private to this user.

Why. A bundle's HMAC (surgery.runtime.signing) proves its bytes at the moment surgery reads
them, and nothing after. torch does not run a bundle's code from memory alone:
``torch.compiler.load_cache_artifacts`` writes the Mega-Cache entries as files into inductor's
cache folder (``TORCHINDUCTOR_CACHE_DIR``, by default ``$TMPDIR/torchinductor_$USER``), where
torch unpickles them later (torch 2.14 stores an FX-graph entry unread and unpickles it at its
first lookup); loading a precompiled artifact writes or builds its kernels there, and inductor
loads a library it finds already at the path its hash names. Triton does the same in
``TRITON_CACHE_DIR``. So whoever can write into such a folder, or could create it (it sits in
``/tmp``, where anyone may create a name), can put their own pickle or shared library where
torch will load the verified one, and the signature proves nothing. The same folder is
trusted by torch's own compiles anyway, but a deployer who signs bundles has said that code in
them must come from the key holder; surgery does not hand torch a verified bundle whose bytes
another user could replace on the way.

The check, before any byte of a bundle reaches torch (surgery.runtime.cache), for inductor's
cache folder as torch resolves it (the environment variable, else torch's default, mirrored
here so that this check imports nothing of inductor) and ``TRITON_CACHE_DIR`` when set:

- a folder that does not exist yet is created by surgery, mode 0700, as torch would create it;
- the folder itself (its real path, links resolved) is owned by this user and not writable by
  others (writable by this user's own primary group is allowed: a umask of 002 with user
  private groups gives that);
- every folder above it is owned by this user or root, and one that others may write is
  sticky (``/tmp``): no one else can rename or replace what is below it.

A folder that fails makes the bundle ignored with one warning naming the folder, what is wrong
and the fix; the regions compile as usual. What it does not defend: another process of the
same user, or root.
"""

from __future__ import annotations

import getpass
import os
import re
import stat
import tempfile

# What torch reads for its compile-cache folders (torch._inductor.runtime.cache_dir_utils).
INDUCTOR_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"
TRITON_DIR_ENV = "TRITON_CACHE_DIR"


def inductor_cache_dir() -> str:
    """Where torch's inductor keeps its caches: $TORCHINDUCTOR_CACHE_DIR, else its default."""
    given = os.environ.get(INDUCTOR_DIR_ENV)
    if given:
        return os.path.abspath(given)
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.join(tempfile.gettempdir(),
                        "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def cache_dirs() -> list[tuple[str, str]]:
    """(folder, the variable that moves it) for every folder a bundle's code is written to."""
    out = [(inductor_cache_dir(), INDUCTOR_DIR_ENV)]
    if os.environ.get(TRITON_DIR_ENV):
        out.append((os.path.abspath(os.environ[TRITON_DIR_ENV]), TRITON_DIR_ENV))
    return out


def _owner_ok(st: os.stat_result, *, mine_only: bool) -> bool:
    uid = os.geteuid()
    return st.st_uid == uid or (not mine_only and st.st_uid == 0)


def dir_problem(path: str, env: str, *, what: str = "torch's cache folder") -> str | None:
    """Why a bundle's code must not go into the folder ``path`` (None: it is private);
    ``what`` names the folder in the reason (surgery.runtime.bytecode checks its own too)."""
    if not hasattr(os, "geteuid"):  # not POSIX: no owners and modes to check
        return None
    fix = (f"make it private (`chmod 700 {path}`, owned by you) or point {env} at a "
           "folder only you can write")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError as e:
        return f"{what} {path} cannot be made or read ({e.strerror}); {fix}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{what} {path} is not a folder; {fix}"
    if not _owner_ok(st, mine_only=True):
        return (f"{what} {real} belongs to uid {st.st_uid}, not to this user, "
                f"who could put code there to be loaded; {fix}")
    group_mine = st.st_gid == os.getegid()
    if st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and not group_mine):
        return (f"{what} {real} is writable by others (mode "
                f"{stat.S_IMODE(st.st_mode):04o}), so code could be swapped there before it is "
                f"loaded; {fix}")
    parent = os.path.dirname(real)
    while True:
        try:
            pst = os.stat(parent)
        except OSError as e:
            return f"the folder {parent} above {what} cannot be read ({e.strerror}); {fix}"
        open_to_others = pst.st_mode & stat.S_IWOTH or (
            pst.st_mode & stat.S_IWGRP and pst.st_gid != os.getegid())
        if not _owner_ok(pst, mine_only=False) or (open_to_others and
                                                   not pst.st_mode & stat.S_ISVTX):
            return (f"the folder {parent} above {what} {real} can be changed by "
                    f"others (owner uid {pst.st_uid}, mode {stat.S_IMODE(pst.st_mode):04o}), "
                    f"who could replace it; {fix}")
        up = os.path.dirname(parent)
        if up == parent:
            return None
        parent = up


def private_dirs_problem() -> str | None:
    """The first reason a bundle's code must not be handed to torch here, or None."""
    for path, env in cache_dirs():
        if why := dir_problem(path, env):
            return why
    return None
