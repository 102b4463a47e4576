"""rankguard callbacks for the OLMo-core ``Trainer`` (``olmo_core.train``).

Holds ``RankGuard`` and one callback per guard (settings declared in
``rankguard.integrations._api``), and :func:`hook_trainer`, :func:`hook_metric_flush`,
:func:`save_options`, :func:`route_checkpoint_dir_waits` (OLMo-core's private names are read
in :mod:`rankguard.integrations.private.olmo_core`).
Requires ``pip install 'rankguard[olmo-core]'``.
See docs/integrations.md#olmo-core-where-each-event-comes-from.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

# The core guard: this module's own ``SharedDirBarrier`` is the OLMo-core callback of that name.
from rankguard.callbacks.checkpoint.shared_dir_barrier import (
    SharedDirBarrier as CoreSharedDirBarrier,
)
from rankguard.callbacks.core.events import LoaderFacts, ResumeFacts
from rankguard.callbacks.core.guard import Guard
from rankguard.integrations import _api
from rankguard.integrations._adapter import Adapter
from rankguard.integrations._common import Unhook, metric_reduction_check, wrap_method
from rankguard.integrations._driver import EventDriver
from rankguard.integrations.olmo_core_flush import FLUSH, FLUSH_FIX, FLUSH_NOTES, hook_metric_flush
from rankguard.integrations.private.olmo_core import attached_trainer, route_checkpoint_dir_waits

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
#: OLMo-core's own guard settings. A local save folder must be shared by every node (its
#: Trainer refuses one that is not unless ``OLMO_SHARED_FS=1`` says it is). Python ``random``
#: and numpy states differ between ranks in a healthy run: OLMo-core draws from ``random`` on
#: the rank that writes its data indices, and a resume restores each rank's own states; its
#: data order comes from the data loader's ``seed`` (datasets are still compared).
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


# -- decisions ---------------------------------------------------------------------------


def announces_resume(no_checkpoints: bool, load_strategy: LoadStrategy) -> bool:
    """Whether a fit announces RESUMED: where ``Trainer.fit`` may load a checkpoint."""
    return not no_checkpoints and load_strategy != LoadStrategy.never


def resumed_from_load_path(checkpoint: str | None, load_path: Any, save_folder: str) -> bool:
    """Whether ``checkpoint`` came from ``load_path``, not the save folder (tried first)."""
    if checkpoint is None or load_path is None:
        return False
    return not checkpoint.startswith(normalize_path(save_folder) + "/")


def rank0_timeout(timeout: float, barrier_timeout_s: float | None, fitting: bool) -> float:
    """Rank 0's wait for its last checkpoint: the barrier's ``timeout_s`` while fitting."""
    if barrier_timeout_s is None or not fitting:
        return timeout
    return max(timeout, barrier_timeout_s)


# -- the wrapped public methods ----------------------------------------------------------


class _Hooks:
    """What :func:`hook_trainer`'s wrappers call: the driver's events with OLMo-core's facts."""

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
        """Rank 0's wait for its last checkpoint (:func:`rank0_timeout`)."""
        barrier_timeout = None if self.barrier is None else self.barrier.timeout_s
        return rank0_timeout(timeout, barrier_timeout, self.driver.fitting)

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


Wrapper = tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]


def trainer_wrappers(
    trainer: Trainer, hooks: _Hooks, watched: Iterable[Evaluator]
) -> list[Wrapper]:
    """The OLMo-core methods whose calls mark evals and saves: ``(instance, name, make)``.

    The one place rankguard relies on how OLMo-core calls its public API:
    ``Trainer.save_checkpoint`` / ``save_checkpoint_async`` for every save;
    the ``EvaluatorCallback`` calling each evaluator's ``reset_metrics``
    before its first batch, ``TrainModule.eval_batch`` per batch and
    ``compute_metrics`` after its last. ``tests/integrations/test_olmo_core.py`` fails if
    that changes.
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

    wrappers: list[Wrapper] = [
        (trainer, "save_checkpoint", saving),
        (trainer, "save_checkpoint_async", saving),
        (trainer.train_module, "eval_batch", batch),
    ]
    for evaluator in watched:
        wrappers += [(evaluator, "reset_metrics", starting(evaluator))]
        wrappers += [(evaluator, "compute_metrics", ending)]
    return wrappers


def hook_trainer(trainer: Trainer, hooks: _Hooks, watched: Iterable[Evaluator]) -> list[Unhook]:
    """Wraps, on these instances, :func:`trainer_wrappers`; returns each wrapper's undo."""
    return [wrap_method(*wrapper) for wrapper in trainer_wrappers(trainer, hooks, watched)]


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
    from_load_path = resumed_from_load_path(checkpoint, load_path, folder)
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


class _OlmoCoreAdapter(Adapter, Callback):
    """Drives the guards (:class:`Adapter`) from OLMo-core ``Callback`` hooks."""

    #: Above every OLMo-core callback (the checkpointer's is 1): rankguard's
    #: fit-start checks run before the pre-train save and ``eval_on_startup``.
    priority: ClassVar[int] = 10
    #: OLMo-core's own guard settings, under the user's (``rankguard.integrations._api``).
    framework_defaults = DEFAULTS

    def __init__(self, guards: list[Guard], exchange_timeout_s: float = 300.0) -> None:
        super().__init__(guards, exchange_timeout_s)
        self._train: LoaderFacts | None = None
        self._unhook_load: Unhook | None = None  # for the callback's life, not one fit's
        self._loaded_from: str | None = None

    def _flush_metrics(self) -> None:
        trainer = attached_trainer(self)
        if trainer is not None:
            for name, value in self.take_metrics().items():
                trainer.record_metric(name, float(value), merge_strategy=MetricMergeStrategy.latest)

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

    def pre_train(self) -> None:
        """FIT_START with the train loader, every evaluator's batches, model and optimizer."""
        if self.driver.fitting:  # a second fit() on the same Trainer
            self.stop()
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
        for wrapper in trainer_wrappers(trainer, hooks, [evaluator for evaluator, _ in watched]):
            self.wrap(*wrapper)
        if barrier is not None:
            self.add_undo(route_checkpoint_dir_waits(hooks.checkpoint_folder, hooks.patience))
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
            self.add_undo(hook_metric_flush(trainer, check))
        loaded, self._loaded_from = self._loaded_from, None
        if announces_resume(trainer.no_checkpoints, trainer.load_strategy):
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
            self.driver.train_batch_start(batch)
            if self._metrics:  # the guards' metrics (Adapter.buffer_metrics), rarely any
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
            self.unwrap()
            self.fail(exc)

    def close(self) -> None:
        """FIT_END after a successful fit (after the final save); then the guards stop.

        Safe to call twice and after an error.
        """
        try:
            if self.driver.fitting:
                self.driver.fit_end()
        finally:
            self.stop()


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


__all__ = [
    "checkpoint_to_load",
    "hook_metric_flush",
    "hook_trainer",
    "save_options",
    *_api.CLASS_NAMES,
]
