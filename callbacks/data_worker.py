"""Recognising data-loader failures in an exception, with the likely cause.

PyTorch reports a dead loader worker as ``DataLoader worker (pid(s) ...)
exited unexpectedly`` or ``... is killed by signal: Killed``, an exception
inside a worker as ``Caught ValueError in DataLoader worker process 0``, and a
stuck one as ``DataLoader timed out after N seconds``; OLMo-style threaded
loaders as ``data thread 3 failed``. The training framework propagates these
without saying which rank it was; ``DataStallMonitor.on_error`` logs the rank
and step using :func:`worker_failure`.
"""

from __future__ import annotations

import re

__all__ = ["worker_failure"]

_CAUSES = (
    (
        re.compile(
            r"DataLoader worker \(pid(?:\(s\))?[^)]*\) (exited unexpectedly|is killed by signal)"
        ),
        "a DataLoader worker process died. Usually host memory (the OOM killer; check `dmesg`) "
        "or shared memory (/dev/shm too small in containers: docker `--shm-size`, or fewer "
        "num_workers / a smaller prefetch_factor).",
    ),
    (
        re.compile(r"Caught \w+ in DataLoader worker process \d+"),
        "the dataset raised inside a DataLoader worker; the worker's traceback follows in the "
        "error. Run with num_workers=0 to debug it in the main process.",
    ),
    (
        re.compile(r"DataLoader timed out after [\d.]+ seconds"),
        "a DataLoader worker produced no batch within the loader's `timeout`: storage is "
        "too slow or a worker is stuck.",
    ),
    (
        re.compile(r"data thread \d+ failed"),
        "a data-loading thread failed, typically because reads from remote storage could "
        "not keep up or timed out: use local or same-region storage, more workers, or a "
        "larger prefetch.",
    ),
)
_MAX_CHAIN = 8


def worker_failure(exc: BaseException) -> str | None:
    """Describes a data-loader failure found in ``exc`` or its causes.

    Args:
        exc: Any exception; its ``__cause__``/``__context__`` chain is searched.

    Returns:
        ``"<what failed> (<original message, first line>)"``, or ``None`` if the
        chain holds no recognised data-loader failure.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < _MAX_CHAIN:
        seen.add(id(current))
        text = str(current)
        for pattern, cause in _CAUSES:
            match = pattern.search(text)
            if match:
                line = next((ln for ln in text.splitlines() if match.group(0) in ln), text)
                return f"data loading failed: {cause} ({type(current).__name__}: {line.strip()})"
        current = current.__cause__ or current.__context__
    return None
