"""A process's view of a folder as an NFS client with a negative lookup cache shows it.

:class:`NegativeLookupCache` hides, for ``lag_s`` seconds after a folder was made
(or renamed: its ``ctime``), every lookup of it and below it in this process:
``stat``/``lstat`` say ``ENOENT`` and the parent's listing leaves it out (or, with
``listed=True``, shows it), while ``mkdir`` still asks the real filesystem and says
``EEXIST``, as a client whose cached "not there" outlives the server's folder does.
Other files and folders, and fresh names (rankguard's probe markers), are shown at
once. It patches ``os`` in this process only, so a real trainer's ``Path.exists``,
``os.makedirs`` and ``os.listdir`` see what rankguard's own lookups see.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["NegativeLookupCache"]


class NegativeLookupCache:
    """Hides folders that ``hides(path)`` selects for ``lag_s`` after their ``ctime``.

    Args:
        root: Only paths below this folder are looked at.
        lag_s: How long after it was made (or renamed) a selected folder stays hidden.
        hides: Which folders (absolute paths below ``root``) the cache hides.
        listed: Whether the parent's listing shows a hidden folder (``readdir`` not
            cached) or leaves it out too.

    Attributes:
        hidden: Per folder, the longest it was reported missing while there (s).
    """

    def __init__(
        self,
        root: str,
        lag_s: float,
        hides: Callable[[str], bool] = lambda path: True,
        listed: bool = False,
    ) -> None:
        self.root = os.path.abspath(root)
        self.lag_s, self.hides, self.listed = lag_s, hides, listed
        self.hidden: dict[str, float] = {}
        #: Per folder, its ``ctime`` when first found (made, or renamed there); once shown
        #: it stays shown (files written into it later change its ``ctime`` again).
        self._made: dict[str, float] = {}
        self._real: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _hidden_ancestor(self, path: Any) -> str | None:
        """The folder at or above ``path`` the cache hides now, if any."""
        if not isinstance(path, str | os.PathLike):
            return None  # a file descriptor
        path = os.path.abspath(os.fsdecode(path))
        if not path.startswith(self.root + os.sep):
            return None
        here = path
        while here != self.root:
            if self.hides(here):
                try:
                    ctime = self._real["lstat"](here).st_ctime
                except OSError:
                    ctime = None
                if ctime is not None:
                    with self._lock:
                        age = time.time() - self._made.setdefault(here, ctime)
                        if age < self.lag_s:
                            self.hidden[here] = max(self.hidden.get(here, 0.0), age)
                            return here
            here = os.path.dirname(here)
        return None

    def _missing(self, path: Any) -> OSError:
        return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fsdecode(path))

    def __enter__(self) -> NegativeLookupCache:
        self._real = {name: getattr(os, name) for name in ("stat", "lstat", "listdir", "scandir")}
        real = self._real

        def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
            if self._hidden_ancestor(path):
                raise self._missing(path)
            return real["stat"](path, *args, **kwargs)

        def lstat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
            if self._hidden_ancestor(path):
                raise self._missing(path)
            return real["lstat"](path, *args, **kwargs)

        def listdir(path: Any = ".") -> list:
            if self._hidden_ancestor(path):
                raise self._missing(path)
            names = real["listdir"](path)
            if self.listed or not isinstance(path, str | os.PathLike):
                return names
            folder = os.fsdecode(path)
            return [n for n in names if not self._hidden_ancestor(os.path.join(folder, n))]

        def scandir(path: Any = ".") -> Any:
            if self._hidden_ancestor(path):
                raise self._missing(path)
            entries = list(real["scandir"](path))
            if not self.listed:
                entries = [e for e in entries if not self._hidden_ancestor(e.path)]
            return _Entries(entries)

        os.stat, os.lstat, os.listdir, os.scandir = stat, lstat, listdir, scandir
        return self

    def __exit__(self, *exc: object) -> None:
        for name, function in self._real.items():
            setattr(os, name, function)


class _Entries(list):
    """``os.scandir``'s result as a context manager (a filtered list of its entries)."""

    def __enter__(self) -> _Entries:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def close(self) -> None:
        return None
