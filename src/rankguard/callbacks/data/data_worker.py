"""Recognising data-loader failures in an exception, with the likely cause.

PyTorch reports a dead loader worker as ``DataLoader worker (pid(s) ...)
exited unexpectedly`` or ``... is killed by signal: Killed``, an exception
inside a worker as ``Caught ValueError in DataLoader worker process 0``, and a
stuck one as ``DataLoader timed out after N seconds``; OLMo-style threaded
loaders as ``data thread 3 failed``. A worker that dies while the main
process receives its batch (tensors travel as file descriptors fetched from
the worker) may also surface as a bare ``ConnectionResetError`` or
``EOFError`` raised inside the DataLoader, before torch noticed the death.
The training framework propagates these without saying which rank it was;
``DataStallMonitor.on_error`` logs the rank and step using :func:`worker_failure`.
"""

from __future__ import annotations

import re
import traceback
from pathlib import PurePath

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
_LOST_WORKER = (
    "the connection to a DataLoader worker broke while receiving a batch; the worker most "
    "likely died. Usually host memory (the OOM killer; check `dmesg`) or shared memory "
    "(/dev/shm too small in containers: docker `--shm-size`, or fewer num_workers / a "
    "smaller prefetch_factor)."
)
#: Where torch's DataLoader receives a batch from its workers (file, function).
_RECEIVE = (("torch", "utils", "data", "dataloader.py"), "_try_get_data")


def _lost_worker(exc: BaseException) -> bool:
    """Whether ``exc`` is a broken connection raised while a DataLoader received a batch.

    Only the receiving function counts: the same error from a dataset's own code
    (a remote read with ``num_workers=0``) is not a worker failure.
    """
    if not isinstance(exc, ConnectionError | EOFError):
        return False
    path, function = _RECEIVE
    codes = (frame.f_code for frame, _ in traceback.walk_tb(exc.__traceback__))
    return any(c.co_name == function and PurePath(c.co_filename).parts[-4:] == path for c in codes)


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
    if _lost_worker(exc):
        first = str(exc).splitlines()[0] if str(exc) else ""
        return f"data loading failed: {_LOST_WORKER} ({type(exc).__name__}: {first})"
    return None
