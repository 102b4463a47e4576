"""When a DataLoader handed over its batch, for fetch windows that also hold a collective.

:class:`LoaderReturnClock` ends a data wait when the loader's iterator returns
the batch (a profile function armed only after a fetch window that looked
slow), not when the framework's window ends. See docs/data.md#the-loaders-return-clock.
"""

from __future__ import annotations

import sys
import time
from functools import cache
from types import CodeType, FrameType
from typing import Any

from torch.utils.data import DataLoader

__all__ = ["LoaderReturnClock", "loader_next_code"]


@cache
def loader_next_code() -> CodeType | None:
    """The code of ``__next__`` shared by every DataLoader iterator, or ``None``.

    Found through an iterator of an empty loader rather than by torch's private
    base class name; ``None`` (no clock) if torch ever makes it a C method.
    """
    next_method = getattr(type(iter(DataLoader([]))), "__next__", None)
    return getattr(next_method, "__code__", None)


class LoaderReturnClock:
    """Records when a DataLoader iterator's ``__next__`` returns on this thread.

    Example::

        clock = LoaderReturnClock()
        clock.arm(loader)
        batch = next(iterator)  # plus whatever else the framework does
        returned_at = clock.disarm()  # time.perf_counter() at the return, or None
    """

    def __init__(self) -> None:
        self._hook = self._profile  # one bound method: identity checks below
        self._code: CodeType | None = None
        self._depth = 0
        self._returned_at: float | None = None
        self._armed = False

    @staticmethod
    def watchable(loader: Any) -> bool:
        """Whether :meth:`arm` can watch ``loader``: a DataLoader, and no other profiler runs."""
        return LoaderReturnClock.can_watch(loader) and sys.getprofile() is None

    @staticmethod
    def can_watch(loader: Any) -> bool:
        """Whether ``loader`` is one the clock can watch (a DataLoader), whatever else runs.

        :meth:`watchable` is this and no other profiler: a caller that asks for the
        same loader every step may keep this answer and ask ``sys.getprofile()`` alone.
        """
        return isinstance(loader, DataLoader) and loader_next_code() is not None

    def arm(self, loader: Any) -> bool:
        """Starts watching if :meth:`watchable`.

        Returns:
            Whether the clock is armed.
        """
        self.disarm()
        if not self.watchable(loader):
            return False
        self._code = loader_next_code()
        self._armed = True
        sys.setprofile(self._hook)
        return True

    def disarm(self) -> float | None:
        """Stops watching; returns when ``__next__`` returned since :meth:`arm`, or ``None``."""
        if self._armed and sys.getprofile() is self._hook:
            sys.setprofile(None)
        returned_at, self._returned_at = self._returned_at, None
        self._armed = False
        self._depth = 0
        return returned_at

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if frame.f_code is not self._code:
            return
        if event == "call":
            self._depth += 1
        elif event == "return":
            self._depth -= 1
            if self._depth <= 0:  # the outermost loader returned (a batch or StopIteration)
                self._returned_at = time.perf_counter()
                sys.setprofile(None)
