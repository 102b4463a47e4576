"""Every private name of OLMo-core's ``Trainer`` rankguard reads, each in one function.

Read from ai2-olmo-core 2.4 and 3.0; ``tests/integrations/test_private_olmo_core.py``
calls each against the installed OLMo-core and fails if it renames or moves what
is read. Requires ``pip install 'rankguard[olmo-core]'``.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from pathlib import PurePath
from typing import Any

from rankguard.integrations._common import Unhook, wrap_method

__all__ = [
    "WAIT_SITES",
    "attached_trainer",
    "pending_flush",
    "polled_folder",
    "route_checkpoint_dir_waits",
    "wrap_metric_flush",
]

#: The adapter's logger: what it says is found where it always was.
logger = logging.getLogger("rankguard.integrations.olmo_core")


def attached_trainer(callback: Any) -> Any | None:
    """The ``Trainer`` an OLMo-core ``Callback`` is attached to, or ``None`` before it is.

    Reads ``Callback._trainer``: the public ``Callback.trainer`` asserts that one
    is attached, and a callback built outside a Trainer (or closed before it was
    attached) has none.
    """
    return callback._trainer  # type: ignore[no-any-return]


def pending_flush(trainer: Any) -> tuple[Mapping[int, Mapping[str, Any]], Mapping[str, Any], Any]:
    """What the Trainer's next metric flush reduces: ``(metrics, reduce_types, consistent)``.

    Reads ``Trainer._metrics`` (values per name per step since the last flush),
    ``_metrics_reduce_type`` (each name's reduce type, ever recorded) and
    ``_metrics_consistent`` (``None`` before the first flush, then its verdict on
    the names). OLMo-core has no public view of the metrics before it reduces them:
    ``record_metric`` only adds, and ``log_metrics`` callbacks see them reduced.
    """
    return trainer._metrics, trainer._metrics_reduce_type, trainer._metrics_consistent


def wrap_metric_flush(trainer: Any, make: Callable[[Callable[..., Any]], Any]) -> Unhook:
    """Wraps, on the instance, the Trainer's metric flush (``Trainer._log_metrics``); the undo.

    ``_log_metrics`` starts each flush on the training thread, at the same points
    on every rank, before it hands the metrics to their reduction (the bookkeeping
    thread where bookkeeping is asynchronous). No public hook runs there:
    ``pre_log_metrics``/``log_metrics`` run after the reduction.
    """
    return wrap_method(trainer, "_log_metrics", make)


def polled_folder(condition: Callable[[], bool]) -> str | None:
    """The folder a ``wait_for`` condition polls (``Path.exists`` bound, a lambda over one path).

    Reads a lambda's ``__closure__``: OLMo-core passes ``wait_for`` a bare
    condition (``lambda: dir.exists()``), the folder it polls is nowhere else.
    """
    owner = getattr(condition, "__self__", None)  # ``train_dir.exists``
    if isinstance(owner, PurePath):
        return str(owner)
    cells = [c.cell_contents for c in getattr(condition, "__closure__", None) or ()]
    paths = [c for c in cells if isinstance(c, str | PurePath)]  # ``lambda: dir.exists()``
    return str(paths[0]) if len(paths) == 1 else None


#: OLMo-core's modules that poll with ``olmo_core.utils.wait_for`` during a save, and what
#: they poll for: ``"folder"``, a folder the filesystem-local rank 0 made, polled by every
#: rank (routed through the barrier); ``"rank0"``, a condition rank 0 alone polls (its own
#: last checkpoint finalised: given the barrier's ``timeout_s``, no exchange). Read from
#: ai2-olmo-core 2.4 and 3.0 (3.0 moved the checkpointer's own to ``Checkpointer.FS_TIMEOUT``,
#: 120 s; the other two still wait 10 s). ``tests/integrations/test_private_olmo_core.py``
#: fails if the installed OLMo-core calls ``wait_for`` in a module not listed here.
WAIT_SITES: dict[str, str] = {
    # Checkpointer._get_tmp_dir, _save_train_state, _prepare_dir, _teardown_tmp_dir
    "olmo_core.train.checkpoint": "folder",
    # _prepare_env_for_save (3.0: the DDP train module's save_state_dict_direct)
    "olmo_core.distributed.checkpoint": "folder",
    # CheckpointerCallback._await_last_checkpoint (async saves), rank 0 only
    "olmo_core.train.callbacks.checkpointer": "rank0",
}

#: Why :func:`route_checkpoint_dir_waits` left a module alone, once per process.
_NOT_ROUTED: set[str] = set()


def route_checkpoint_dir_waits(
    wait: Callable[[str], bool], patience: Callable[[float], float] | None = None
) -> Unhook:
    """Makes OLMo-core's checkpoint waits go through rankguard, in every module that has one.

    Replaces, module-wide until the returned undo, the name ``wait_for``
    (``olmo_core.utils.wait_for``, polling every 0.5 s until its ``timeout``) in each
    module of :data:`WAIT_SITES`: OLMo-core's checkpointer polls its folders there with
    a fixed timeout, and no setting or hook reaches those polls. A ``"folder"`` poll
    (the filesystem-local rank 0 made ``step<N>-tmp``, its ``train/``, the renamed
    ``step<N>`` or a ``model_and_optim`` folder; every rank then polls with
    ``Path.exists``) first calls ``wait(path)`` on every rank, which may exchange
    across ranks; OLMo-core's own ``wait_for`` runs where ``wait`` declines (returns
    ``False``), for any other condition, and when the folder is still missing after
    ``wait``. A ``"rank0"`` poll (rank 0 alone) never exchanges: it runs OLMo-core's
    ``wait_for`` with the timeout ``patience(timeout)`` gives. A module without that
    name (another OLMo-core) is left alone (logged once at DEBUG).

    Args:
        wait: Waits for a folder on every rank; ``False`` to decline.
        patience: OLMo-core's timeout of a ``"rank0"`` poll to the one to use
            (default: unchanged).

    Returns:
        The undo (safe to call twice).
    """
    unhooks = [
        _route(module, kind, wait, patience or (lambda timeout: timeout))
        for module, kind in WAIT_SITES.items()
    ]

    def unhook() -> None:
        for undo in unhooks:
            undo()

    return unhook


def _route(
    name: str, kind: str, wait: Callable[[str], bool], patience: Callable[[float], float]
) -> Unhook:
    """Replaces ``wait_for`` in module ``name`` (see :func:`route_checkpoint_dir_waits`)."""
    module = importlib.import_module(name)
    original = getattr(module, "wait_for", None)
    if not callable(original):
        if name not in _NOT_ROUTED:
            _NOT_ROUTED.add(name)
            logger.debug(
                "rankguard: %s has no wait_for; its checkpoint polls keep OLMo-core's own timeout",
                name,
            )
        return lambda: None

    def wait_for(condition: Callable[[], bool], description: str, timeout: float = 10.0) -> None:
        if kind == "rank0":
            original(condition, description, patience(timeout))
            return
        folder = polled_folder(condition)
        if folder is not None and wait(folder) and condition():
            return
        original(condition, description, timeout)

    setattr(module, "wait_for", wait_for)  # noqa: B010  (a name mypy does not know)

    def unhook() -> None:
        if getattr(module, "wait_for", None) is wait_for:
            setattr(module, "wait_for", original)  # noqa: B010

    return unhook
