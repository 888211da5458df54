"""The watches of one engine that run on this host: one alone may reconcile it.

The engine counts all its traffic; a watch reconciles it with its own
face's streams. Where several watches share an engine (an app served by
worker processes, each with a middleware; two sidecars on one engine),
each sees only its part, and each would count the others' tokens as
unseen and wait on their requests after a cancel. So each watch holds an
exclusive ``flock`` on a file of its own, in a directory named for the
engine's URL, and counts the files still locked: a lock is the kernel's
word that its holder is alive (a process that died, even by ``SIGKILL``,
holds none), so a dead worker's file is taken for stale and removed.

Only this host is seen (one temporary directory, one user): replicas on
other machines stay invisible, which the README says.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import stat
import tempfile
from pathlib import Path

try:  # POSIX only: elsewhere a watch cannot see its peers, and says so.
    import fcntl
except ImportError:  # pragma: no cover - not on the platforms CI runs
    fcntl = None  # type: ignore[assignment]

__all__ = ["EngineWatchers"]

log = logging.getLogger("streamwarden.engine")


class EngineWatchers:
    """This watch's place among the watches of one engine on this host."""

    def __init__(self, engine_url: str, directory: str | None = None) -> None:
        # The URL is hashed: it may carry credentials, and a file name has a length limit.
        key = hashlib.sha256(engine_url.encode()).hexdigest()[:32]
        base = Path(directory or tempfile.gettempdir()) / f"streamwarden-{os.getuid()}"
        self._base = base
        self._directory = base / f"engine-watch-{key}"
        self._own: Path | None = None
        self._fd: int | None = None

    @property
    def joined(self) -> bool:
        """This watch holds its lock, so the others count it."""
        return self._fd is not None

    def join(self) -> None:
        """Hold this watch's lock (until :meth:`leave`, or this process's end).

        If it cannot (no ``fcntl``, a directory it does not own), it logs
        why, and :meth:`count` is 1: the watch behaves as if alone.
        """
        if self._fd is not None or fcntl is None:
            if fcntl is None:
                log.warning("engine watch: no flock here, other watches of the engine unseen")
            return
        try:
            for directory in (self._base, self._directory):
                with contextlib.suppress(FileExistsError):
                    directory.mkdir(mode=0o700)
                _check_own_directory(directory)
            name = f"{os.getpid()}-{secrets.token_hex(8)}"
            # Locked under a hidden name, then renamed: a counter never sees
            # the file unlocked, so never takes a starting watch for a dead one.
            hidden = self._directory / f".{name}"
            fd = os.open(hidden, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                own = self._directory / name
                os.rename(hidden, own)
            except OSError:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(hidden)
                raise
        except OSError as exc:
            log.warning("engine watch: cannot see other watches of the engine: %s", exc)
            return
        self._fd, self._own = fd, own

    def count(self) -> int:
        """The watches of this engine alive on this host, this one included."""
        if self._fd is None:
            return 1
        alive = 1
        try:
            entries = list(os.scandir(self._directory))
        except OSError:
            return 1
        for entry in entries:
            if entry.name.startswith(".") or entry.path == str(self._own):
                continue
            if _locked(entry.path):
                alive += 1
        return alive

    def leave(self) -> None:
        """Drop this watch's lock and file."""
        if self._fd is None:
            return
        if self._own is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._own)
        os.close(self._fd)
        self._fd = self._own = None


def _check_own_directory(directory: Path) -> None:
    """A directory of this user's, not a link another user planted in /tmp."""
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(f"{directory} is not a directory of this user's")


def _locked(path: str) -> bool:
    """Whether a live watch holds ``path``'s lock; a stale file is removed."""
    assert fcntl is not None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False  # gone: its watch left
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)  # its process died without leaving
        return False
    finally:
        os.close(fd)
