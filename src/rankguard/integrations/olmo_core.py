"""rankguard callbacks for the OLMo-core ``Trainer`` (``olmo_core.train``).

Holds ``RankGuard`` and one callback per guard (settings declared in
``rankguard.integrations._api``), and :func:`hook_trainer`, :func:`hook_metric_flush`,
:func:`save_options`, :func:`route_checkpoint_dir_waits`.
Requires ``pip install 'rankguard[olmo-core]'``.
See docs/integrations.md#olmo-core-where-each-event-comes-from.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import PurePath
from typing import Any, ClassVar

# The core guard: this module's own ``SharedDirBarrier`` is the OLMo-core callback of that name.
from rankguard.callbacks.checkpoint.shared_dir_barrier import (
    SharedDirBarrier as CoreSharedDirBarrier,
)
from rankguard.callbacks.core.events import LoaderFacts, ResumeFacts
from rankguard.callbacks.core.guard import Guard, GuardRunner
from rankguard.integrations import _api
from rankguard.integrations._common import Unhook, metric_reduction_check, wrap_method
from rankguard.integrations._driver import EventDriver
from rankguard.integrations.olmo_core_flush import FLUSH, FLUSH_FIX, FLUSH_NOTES, hook_metric_flush

try:
    from olmo_core.eval import Evaluator
    from olmo_core.io import is_url, normalize_path
    from olmo_core.train import LoadStrategy, Trainer
    from olmo_core.train.callbacks import Callback, CheckpointerCallback, EvaluatorCallback
    from olmo_core.train.common import DurationUnit, MetricMergeStrategy
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "rankguard.integrations.olmo_core needs OLMo-core: pip install 'rankguard[olmo-core]'"
    ) from exc

logger = logging.getLogger(__name__)

#: Where OLMo-core saves checkpoints every node can read, named in rankguard's messages.
UPLOAD_SETTING = (
    "save to remote storage: TrainerConfig(save_folder='s3://...') (or gs://, r2://, weka://), "
    "or give the resume as TrainerConfig(load_path=<URL>)"
)
#: OLMo-core's setting that makes its checkpointer's saves sharded (the default) or full.
SHARDED_SETTING = (
    "TransformerTrainModuleConfig(state_dict_save_opts={'full_state_dict': False, "
    "'cpu_offload': True, 'flatten_optimizer_state_dict': True})"
)
#: OLMo-core's own guard settings. A local save folder must be shared by every node (its
#: Trainer refuses one that is not unless ``OLMO_SHARED_FS=1`` says it is). Python ``random``
#: and numpy states differ between ranks in a healthy run: OLMo-core draws from ``random`` on
#: the rank that writes its data indices, and a resume restores each rank's own states; its
#: data order comes from the data loader's ``seed`` (datasets are still compared).
#: How an OLMo-core job resumes every rank from one checkpoint, and keeps each rank's own state.
RESUME_FIX = (
    "resume every rank from one copy: TrainerConfig(save_folder=...) on storage every node "
    "mounts (OLMO_SHARED_FS=1 only where it is shared) or a URL (s3://, gs://), or the same "
    "checkpoint copied to every node before the restart"
)
RESUME_DATA_FIX = (
    "keep every rank's train/rank{N}.pt in the checkpoint: where a rank's file is missing, "
    "OLMo-core's Checkpointer.load restores train/rank0.pt (rank 0's data loader state and "
    "random states) on that rank"
)
DEFAULTS: dict[str, dict[str, Any]] = {
    "shared_dir_barrier": {"on_node_local": "raise"},
    "data_consistency_guard": {"check_rng": False},
}


def checkpoint_to_load(trainer: Trainer, folder: str) -> str:
    """The checkpoint ``trainer.load_checkpoint(folder)`` reads, as this rank sees it.

    ``folder`` itself if it is a checkpoint, else its latest ``step<N>``, the
    way OLMo-core's rank 0 finds it; where this rank finds none, a ``step*``
    that does not exist (so a node without it is named). A URL is given back
    as it is (every node reads the same remote storage).
    """
    folder = str(folder)
    checkpointer = trainer.checkpointer
    if is_url(folder) or checkpointer.dir_is_checkpoint(folder):
        return folder
    try:
        return str(checkpointer.latest_checkpoint(folder))
    except FileNotFoundError:
        return os.path.join(folder, "step*")


def planned_eval_batches(evaluator: Evaluator, callback: EvaluatorCallback) -> int | None:
    """The batches ``callback`` runs of ``evaluator``: its length, cut by ``eval_duration``."""
    total = evaluator.total_batches
    duration = callback.eval_duration
    if duration.unit == DurationUnit.steps:
        return duration.value if total is None else min(total, duration.value)
    if duration.unit == DurationUnit.epochs and duration.value == 1:
        return total
    return None  # a token budget: known only as it runs


def evaluators(trainer: Trainer) -> list[tuple[Evaluator, EvaluatorCallback]]:
    """The evaluators the Trainer's ``EvaluatorCallback`` instances run (none with ``no_evals``)."""
    if trainer.no_evals:
        return []
    return [
        (evaluator, callback)
        for callback in trainer.callbacks.values()
        if isinstance(callback, EvaluatorCallback)
        for evaluator in callback.evaluators
    ]


def save_folder(trainer: Trainer) -> str | None:
    """Where the Trainer's checkpoints go, or ``None`` if it saves none."""
    checkpointers = [c for c in trainer.callbacks.values() if isinstance(c, CheckpointerCallback)]
    if trainer.no_checkpoints or not any(c.enabled for c in checkpointers):
        return None
    return str(trainer.save_folder)


def save_options(train_module: Any) -> tuple[str, bool]:
    """What the checkpointer's saves are, from the train module's public save options.

    OLMo-core's checkpointer always writes through ``torch.distributed.checkpoint``;
    what it writes is ``train_module.state_dict_to_save()``, built with the
    ``state_dict_save_opts`` of ``TransformerTrainModuleConfig`` (default
    ``full_state_dict=False, cpu_offload=True``): a sharded save, each rank its own
    part. ``full_state_dict=True`` makes it a full (unsharded) model export,
    consolidated on rank 0. The one place rankguard reads that attribute;
    ``tests/integrations/test_olmo_core.py`` fails if OLMo-core changes it.

    Returns:
        ``("full" | "sharded", copies_to_host)``: ``copies_to_host`` when
        ``cpu_offload`` builds the whole state dict in host memory before writing.
        A train module without those options (``BasicTrainModule``) saves sharded,
        offloaded to the host.
    """
    options = getattr(train_module, "state_dict_save_opts", None)
    if options is None:
        return "sharded", True
    kind = "full" if options.full_state_dict else "sharded"
    return kind, bool(options.cpu_offload)


def sharded_switch(train_module: Any) -> Callable[[], str] | None:
    """Makes the train module's later saves sharded, for ``CheckpointPlanner(mode="auto")``.

    ``None`` where it has no ``state_dict_save_opts`` to change. OLMo-core reads
    them at every save.
    """
    if getattr(train_module, "state_dict_save_opts", None) is None:
        return None

    def switch() -> str:
        options = train_module.state_dict_save_opts
        train_module.state_dict_save_opts = dataclasses.replace(options, full_state_dict=False)
        return f"set {type(train_module).__name__}.state_dict_save_opts.full_state_dict to False"

    return switch


#: OLMo-core's modules that poll with ``olmo_core.utils.wait_for`` during a save, and what
#: they poll for: ``"folder"``, a folder the filesystem-local rank 0 made, polled by every
#: rank (routed through the barrier); ``"rank0"``, a condition rank 0 alone polls (its own
#: last checkpoint finalised: given the barrier's ``timeout_s``, no exchange). Read from
#: ai2-olmo-core 2.4 and 3.0 (3.0 moved the checkpointer's own to ``Checkpointer.FS_TIMEOUT``,
#: 120 s; the other two still wait 10 s). ``tests/integrations/test_olmo_core.py`` fails if
#: the installed OLMo-core calls ``wait_for`` in a module not listed here.
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


def polled_folder(condition: Callable[[], bool]) -> str | None:
    """The folder a ``wait_for`` condition polls (``Path.exists`` bound, a lambda over one path)."""
    owner = getattr(condition, "__self__", None)  # ``train_dir.exists``
    if isinstance(owner, PurePath):
        return str(owner)
    cells = [c.cell_contents for c in getattr(condition, "__closure__", None) or ()]
    paths = [c for c in cells if isinstance(c, str | PurePath)]  # ``lambda: dir.exists()``
    return str(paths[0]) if len(paths) == 1 else None


def route_checkpoint_dir_waits(
    wait: Callable[[str], bool], patience: Callable[[float], float] | None = None
) -> Unhook:
    """Makes OLMo-core's checkpoint waits go through rankguard, in every module that has one.

    The one place rankguard reaches into OLMo-core's private code: the name
    ``wait_for`` (``olmo_core.utils.wait_for``, polling every 0.5 s until its
    ``timeout``) in each module of :data:`WAIT_SITES` is replaced, module-wide, until
    the returned undo. A ``"folder"`` poll (the filesystem-local rank 0 made
    ``step<N>-tmp``, its ``train/``, the renamed ``step<N>`` or a
    ``model_and_optim`` folder; every rank then polls with ``Path.exists``) first calls
    ``wait(path)`` on every rank, which may exchange across ranks; OLMo-core's own
    ``wait_for`` runs where ``wait`` declines (returns ``False``), for any other
    condition, and when the folder is still missing after ``wait``. A ``"rank0"`` poll
    (rank 0 alone) never exchanges: it runs OLMo-core's ``wait_for`` with the timeout
    ``patience(timeout)`` gives. A module without that name (another OLMo-core) is left
    alone (logged once at DEBUG). ``tests/integrations/test_olmo_core.py`` fails if
    these polls move.

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


class _Hooks:
    """What :func:`hook_trainer` calls: the driver's events with OLMo-core's facts."""

    def __init__(
        self,
        driver: EventDriver,
        evals: Mapping[int, LoaderFacts],
        barrier: CoreSharedDirBarrier | None = None,
    ) -> None:
        self.driver = driver
        self.evals = evals
        self.barrier = barrier

    def checkpoint_folder(self, path: str) -> bool:
        """During a save, waits with the barrier for a folder OLMo-core's rank 0 made."""
        if self.barrier is None or not (self.driver.fitting and self.driver.saving):
            return False
        self.barrier.run([path], "checkpoint_folder", create=False)
        return True

    def patience(self, timeout: float) -> float:
        """Rank 0's wait for its last checkpoint: the barrier's ``timeout_s`` while fitting."""
        if self.barrier is None or not self.driver.fitting:
            return timeout
        return max(timeout, self.barrier.timeout_s)

    def eval_start(self, evaluator: Evaluator) -> None:
        facts = self.evals.get(id(evaluator))
        if facts is not None and self.driver.fitting:
            if self.driver.evals:  # the previous evaluator never computed its metrics
                self.driver.eval_end()
            self.driver.eval_start([facts])

    def eval_end(self) -> None:
        if self.driver.fitting and self.driver.evals:
            self.driver.eval_end()

    def eval_batch(self, run: Callable[[], Any]) -> Any:
        if not (self.driver.fitting and self.driver.evals):
            return run()
        self.driver.eval_batch_start()
        result = run()
        self.driver.eval_batch_end()
        return result

    def save(self, trainer: Trainer, run: Callable[[], Any]) -> Any:
        if not self.driver.fitting or self.driver.saving:
            return run()
        # The save folder, not the step's own: OLMo-core renames ``step<N>-tmp`` onto it, and
        # its other ranks wait for ``step<N>`` to appear before writing into it.
        self.driver.save_start([str(trainer.save_folder)])
        result = run()
        self.driver.save_end()
        return result


def hook_trainer(trainer: Trainer, hooks: _Hooks, watched: Iterable[Evaluator]) -> list[Unhook]:
    """Wraps, on these instances, the OLMo-core methods whose calls mark evals and saves.

    The one place rankguard relies on how OLMo-core calls its public API:
    ``Trainer.save_checkpoint`` / ``save_checkpoint_async`` for every save;
    the ``EvaluatorCallback`` calling each evaluator's ``reset_metrics``
    before its first batch, ``TrainModule.eval_batch`` per batch and
    ``compute_metrics`` after its last. ``tests/integrations/test_olmo_core.py`` fails if
    that changes.

    Returns:
        The functions that remove each wrapper (safe to call twice).
    """

    def saving(save: Callable[..., Any]) -> Callable[..., Any]:
        return lambda *a, **k: hooks.save(trainer, lambda: save(*a, **k))

    def batch(eval_batch: Callable[..., Any]) -> Callable[..., Any]:
        return lambda *a, **k: hooks.eval_batch(lambda: eval_batch(*a, **k))

    def starting(evaluator: Evaluator) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(reset: Callable[..., Any]) -> Callable[..., Any]:
            def reset_metrics(*a: Any, **k: Any) -> Any:
                hooks.eval_start(evaluator)
                return reset(*a, **k)

            return reset_metrics

        return make

    def ending(compute: Callable[..., Any]) -> Callable[..., Any]:
        def compute_metrics(*a: Any, **k: Any) -> Any:
            hooks.eval_end()
            return compute(*a, **k)

        return compute_metrics

    unhooks = [
        wrap_method(trainer, "save_checkpoint", saving),
        wrap_method(trainer, "save_checkpoint_async", saving),
        wrap_method(trainer.train_module, "eval_batch", batch),
    ]
    for evaluator in watched:
        unhooks.append(wrap_method(evaluator, "reset_metrics", starting(evaluator)))
        unhooks.append(wrap_method(evaluator, "compute_metrics", ending))
    return unhooks


def hook_load(trainer: Trainer, before_load: Callable[[str], None]) -> Unhook:
    """Calls ``before_load(path)`` on every rank before the Trainer's checkpointer reads ``path``.

    ``Trainer.fit`` loads its resume checkpoint before any callback hook: its
    ``load_checkpoint`` resolves a folder's latest checkpoint on rank 0 alone and
    broadcasts it; every rank then reads that path with ``trainer.checkpointer.load``,
    wrapped here on the instance (so a node without it is named before any rank reads).
    """

    def make(load: Callable[..., Any]) -> Callable[..., Any]:
        def checkpointer_load(dir: Any, *args: Any, **kwargs: Any) -> Any:
            before_load(str(dir))
            return load(dir, *args, **kwargs)

        return checkpointer_load

    return wrap_method(trainer.checkpointer, "load", make)


def resume_facts(trainer: Trainer, checkpoint: str | None) -> ResumeFacts:
    """What this rank resumed from: ``checkpoint`` (``None``: a fresh start), counters, loader."""
    folder, load_path = str(trainer.save_folder), trainer.load_path
    from_load_path = (
        checkpoint is not None
        and load_path is not None
        and not checkpoint.startswith(normalize_path(folder) + "/")
    )
    loader = trainer.data_loader
    counters = {"global_step": trainer.global_step, "epoch": trainer.epoch}
    if isinstance(batches := getattr(loader, "batches_processed", None), int):
        counters["batches_processed"] = batches
    return ResumeFacts(
        f"load_path={str(load_path)!r}" if from_load_path else f"save_folder={folder!r} (latest)",
        checkpoint,
        counters,
        loader=loader,
        folder=None if from_load_path else folder,
        restores_rng=True,  # Trainer.load_state_dict, from the same world size
        fix=RESUME_FIX,
        data_fix=RESUME_DATA_FIX,
    )


class _OlmoCoreAdapter(Callback):
    """Drives a :class:`GuardRunner` from OLMo-core ``Callback`` hooks."""

    #: Above every OLMo-core callback (the checkpointer's is 1): rankguard's
    #: fit-start checks run before the pre-train save and ``eval_on_startup``.
    priority: ClassVar[int] = 10
    #: OLMo-core's own guard settings, under the user's (``rankguard.integrations._api``).
    framework_defaults = DEFAULTS

    def __init__(self, guards: list[Guard], exchange_timeout_s: float = 300.0) -> None:
        self.runner = GuardRunner(guards, exchange_timeout_s=exchange_timeout_s)
        self.driver = EventDriver(self.runner, self._log_metrics)
        self._train: LoaderFacts | None = None
        self._metrics: dict[str, float] = {}
        self._unhooks: list[Unhook] = []
        self._unhook_load: Unhook | None = None
        self._loaded_from: str | None = None

    # -- facts -----------------------------------------------------------------------

    def _log_metrics(self, metrics: Mapping[str, float]) -> None:
        self._metrics.update(metrics)

    def _flush_metrics(self) -> None:
        if self._metrics and self._trainer is not None:
            metrics, self._metrics = self._metrics, {}
            for name, value in metrics.items():
                self.trainer.record_metric(
                    name, float(value), merge_strategy=MetricMergeStrategy.latest
                )

    def _load_start(self, path: str) -> None:
        self.driver.load_start(path, upload_setting=UPLOAD_SETTING)

    # -- hooks -----------------------------------------------------------------------

    def post_attach(self) -> None:
        """Wraps the Trainer's ``load_checkpoint`` so a resume is checked before it is read."""
        if self._unhook_load is None:
            self._unhook_load = hook_load(self.trainer, self._load_start)

    def post_checkpoint_loaded(self, path: Any) -> None:
        """Notes the checkpoint this rank loaded (before ``pre_train``: RESUMED comes there)."""
        self._loaded_from = str(path)

    def state_dict(self) -> dict[str, Any]:
        """The guards' checkpoint state (the hang watchdog's calibration), saved per rank."""
        return self.runner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the guards' state from a checkpoint (before ``pre_train``)."""
        self.runner.load_state_dict(state_dict)

    def pre_train(self) -> None:
        """FIT_START with the train loader, every evaluator's batches, model and optimizer."""
        if self.driver.fitting:  # a second fit() on the same Trainer
            self._unhook()
            self.driver.abandon()
        trainer = self.trainer
        self._train = LoaderFacts("train", trainer.data_loader, is_train=True)
        watched = evaluators(trainer)
        evals = {
            id(evaluator): LoaderFacts(
                evaluator.name,
                evaluator.batches,
                is_train=False,
                num_batches=planned_eval_batches(evaluator, callback),
            )
            for evaluator, callback in watched
        }
        guards = self.runner.guards
        barrier = next((g for g in guards if isinstance(g, CoreSharedDirBarrier)), None)
        hooks = _Hooks(self.driver, evals, barrier)
        self._unhooks = hook_trainer(trainer, hooks, [evaluator for evaluator, _ in watched])
        if barrier is not None:
            self._unhooks.append(
                route_checkpoint_dir_waits(hooks.checkpoint_folder, hooks.patience)
            )
        folder = save_folder(trainer)
        module = trainer.train_module
        kind, to_host = save_options(module)
        self.driver.fit_start(
            loaders=[self._train, *evals.values()],
            model=getattr(module, "model", None),
            optimizer=getattr(module, "optim", None),
            directories=[folder] if folder else [],
            state_dict_type=kind,
            switch_to_sharded=sharded_switch(module),
            sharded_setting=SHARDED_SETTING,
            save_copies_to_host=to_host,
            upload_setting=UPLOAD_SETTING,
        )
        check = metric_reduction_check(
            guards, "olmo_core_flush", where=FLUSH, fix=FLUSH_FIX, notes=FLUSH_NOTES
        )
        if check is not None:
            self._unhooks.append(hook_metric_flush(trainer, check))
        loaded, self._loaded_from = self._loaded_from, None
        if not trainer.no_checkpoints and trainer.load_strategy != LoadStrategy.never:
            self.driver.resumed(resume_facts(trainer, loaded))  # restored, before any batch

    def pre_epoch(self) -> None:
        """EPOCH_START."""
        if self.driver.fitting:
            self.driver.epoch_start(self._train)

    def pre_load_batch(self) -> None:
        """DATA_FETCH_START (the previous train batch, or eval, is over)."""
        if self.driver.fitting:
            self.driver.fetch_start()

    def pre_step(self, batch: dict[str, Any]) -> None:
        """DATA_FETCH_END, TRAIN_BATCH_START; records the guards' metrics."""
        if self.driver.fitting:
            self.driver.train_batch_start()
            probe = self.runner.steps.batch_probe
            if probe is not None:  # the first train batches, for the guards that read them
                probe(batch)
            self._flush_metrics()

    def post_train_batch(self) -> None:
        """TRAIN_BATCH_END (before the checkpointer's save)."""
        if self.driver.fitting:
            self.driver.end_train_batch()

    def post_epoch(self) -> None:
        """EPOCH_END."""
        if self.driver.fitting:
            self.driver.epoch_end(self._train)

    def on_error(self, exc: BaseException) -> None:
        """Lets the guards explain the error, then stops them."""
        if self.driver.fitting:
            self._unhook()
            self.driver.abandon(exc)

    def close(self) -> None:
        """FIT_END after a successful fit (after the final save); then the guards stop.

        Safe to call twice and after an error.
        """
        try:
            if self.driver.fitting:
                self.driver.fit_end()
        finally:
            self.driver.fitting = False
            self._unhook()
            self.runner.close()

    def _unhook(self) -> None:
        unhooks, self._unhooks = self._unhooks, []
        for unhook in unhooks:
            unhook()


class RankGuard(_api.RankGuardSettings, _OlmoCoreAdapter):
    """Every rankguard guard with sound defaults, as an OLMo-core ``Callback``."""


class HangWatchdog(_api.HangWatchdogSettings, _OlmoCoreAdapter):
    """The hang watchdog, as an OLMo-core ``Callback``."""


class DataConsistencyGuard(_api.DataConsistencyGuardSettings, _OlmoCoreAdapter):
    """The data consistency guard, as an OLMo-core ``Callback``."""


class DropLastGuard(_api.DropLastGuardSettings, _OlmoCoreAdapter):
    """The drop-last guard, as an OLMo-core ``Callback``."""


class BatchParityGuard(_api.BatchParityGuardSettings, _OlmoCoreAdapter):
    """The batch parity guard, as an OLMo-core ``Callback``."""


class SharedDirBarrier(_api.SharedDirBarrierSettings, _OlmoCoreAdapter):
    """The shared-directory barrier, as an OLMo-core ``Callback``."""


class ResumeGuard(_api.ResumeGuardSettings, _OlmoCoreAdapter):
    """The resume check, as an OLMo-core ``Callback``."""


class CheckpointPlanner(_api.CheckpointPlannerSettings, _OlmoCoreAdapter):
    """The checkpoint planner, as an OLMo-core ``Callback``."""


class DataStallMonitor(_api.DataStallMonitorSettings, _OlmoCoreAdapter):
    """The data stall monitor, as an OLMo-core ``Callback``."""


class StragglerMonitor(_api.StragglerMonitorSettings, _OlmoCoreAdapter):
    """The straggler monitor, as an OLMo-core ``Callback``."""


__all__ = [  # noqa: RUF022
    "checkpoint_to_load",
    "hook_metric_flush",
    "hook_trainer",
    "save_options",
    "BatchParityGuard",
    "CheckpointPlanner",
    "DataConsistencyGuard",
    "DataStallMonitor",
    "DropLastGuard",
    "HangWatchdog",
    "RankGuard",
    "ResumeGuard",
    "SharedDirBarrier",
    "StragglerMonitor",
]
