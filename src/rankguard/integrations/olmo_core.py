"""rankguard callbacks for the OLMo-core ``Trainer`` (``olmo_core.train``).

Holds ``RankGuard`` and one callback per guard (written by
``tools/generate_api.py``), and :func:`hook_trainer`, :func:`save_options`,
:func:`route_checkpoint_dir_waits`. Requires ``pip install 'rankguard[olmo-core]'``.
See docs/integrations.md#olmo-core-where-each-event-comes-from.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import PurePath
from typing import Any, ClassVar

# The core guard: this module's own ``SharedDirBarrier`` is the OLMo-core callback of that name.
from rankguard.callbacks.checkpoint.shared_dir_barrier import (
    SharedDirBarrier as CoreSharedDirBarrier,
)
from rankguard.callbacks.core.events import LoaderFacts
from rankguard.callbacks.core.guard import Guard, GuardRunner
from rankguard.integrations._common import bundle_init, guard_init
from rankguard.integrations._driver import EventDriver

try:
    import olmo_core.train.checkpoint as olmo_checkpoint
    from olmo_core.eval import Evaluator
    from olmo_core.io import is_url
    from olmo_core.train import Trainer
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
DEFAULTS: dict[str, dict[str, Any]] = {
    "shared_dir_barrier": {"on_node_local": "raise"},
    "data_consistency_guard": {"check_rng": False},
}

Unhook = Callable[[], None]


def _wrap(obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Unhook:
    """Replaces ``obj.name`` on the instance with ``make(original)``; returns the undo."""
    original = getattr(obj, name)
    wrapper = functools.wraps(original)(make(original))
    setattr(obj, name, wrapper)

    def unhook() -> None:
        if vars(obj).get(name) is wrapper:
            delattr(obj, name)

    return unhook


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


#: Why :func:`route_checkpoint_dir_waits` left OLMo-core alone, once per process.
_NOT_ROUTED: set[str] = set()


def route_checkpoint_dir_waits(wait: Callable[[str], bool]) -> Unhook:
    """Makes OLMo-core's checkpointer poll for its checkpoint folders through ``wait(path)``.

    The one place rankguard reaches into OLMo-core's private code. It targets
    ai2-olmo-core 2.x (2.4.0 read): ``Checkpointer._get_tmp_dir``,
    ``_save_train_state`` and ``_teardown_tmp_dir`` (``olmo_core/train/checkpoint.py``)
    make ``step<N>-tmp``, its ``train/`` and the renamed ``step<N>`` on the
    filesystem-local rank 0, and then every rank polls for the folder with
    ``wait_for(condition, description, timeout=10.0)`` (that module's name for
    ``olmo_core.utils.wait_for``): a folder a shared filesystem shows late on some
    node is ``TimeoutError: timed out Waiting for checkpoint directory``. That name is
    replaced here, module-wide, until the returned undo: a poll for a folder (a
    ``Path.exists`` bound method, or a lambda over one path) first calls ``wait`` on
    every rank, which may exchange across ranks; OLMo-core's own ``wait_for`` runs
    where ``wait`` declines (returns ``False``), for any other condition, and when the
    folder is still missing after ``wait``. Where that name is absent (another
    OLMo-core version) nothing is changed (logged once at DEBUG).
    ``tests/integrations/test_olmo_core.py`` fails if these polls change.

    Returns:
        The undo (safe to call twice).
    """
    original = getattr(olmo_checkpoint, "wait_for", None)
    if not callable(original):
        if "wait_for" not in _NOT_ROUTED:
            _NOT_ROUTED.add("wait_for")
            logger.debug(
                "rankguard: olmo_core.train.checkpoint has no wait_for; its checkpointer's "
                "folder polls keep OLMo-core's own timeout"
            )
        return lambda: None

    def polled_folder(condition: Callable[[], bool]) -> str | None:
        owner = getattr(condition, "__self__", None)  # ``train_dir.exists``
        if isinstance(owner, PurePath):
            return str(owner)
        cells = [c.cell_contents for c in getattr(condition, "__closure__", None) or ()]
        paths = [c for c in cells if isinstance(c, str | PurePath)]  # ``lambda: dir.exists()``
        return str(paths[0]) if len(paths) == 1 else None

    def wait_for(condition: Callable[[], bool], description: str, timeout: float = 10.0) -> None:
        folder = polled_folder(condition)
        if folder is not None and wait(folder) and condition():
            return
        original(condition, description, timeout)

    olmo_checkpoint.wait_for = wait_for

    def unhook() -> None:
        if olmo_checkpoint.wait_for is wait_for:
            olmo_checkpoint.wait_for = original

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
        _wrap(trainer, "save_checkpoint", saving),
        _wrap(trainer, "save_checkpoint_async", saving),
        _wrap(trainer.train_module, "eval_batch", batch),
    ]
    for evaluator in watched:
        unhooks.append(_wrap(evaluator, "reset_metrics", starting(evaluator)))
        unhooks.append(_wrap(evaluator, "compute_metrics", ending))
    return unhooks


def hook_load(trainer: Trainer, before_load: Callable[[str], None]) -> Unhook:
    """Calls ``before_load(path)`` on every rank before ``trainer.load_checkpoint`` reads.

    ``Trainer.fit`` loads its resume checkpoint before any callback hook, through
    its public ``load_checkpoint(dir, ...)``, wrapped here on the instance.
    """

    def make(load: Callable[..., Any]) -> Callable[..., Any]:
        def load_checkpoint(dir: Any, *args: Any, **kwargs: Any) -> Any:
            before_load(checkpoint_to_load(trainer, dir))
            return load(dir, *args, **kwargs)

        return load_checkpoint

    return _wrap(trainer, "load_checkpoint", make)


class _OlmoCoreAdapter(Callback):
    """Drives a :class:`GuardRunner` from OLMo-core ``Callback`` hooks."""

    #: Above every OLMo-core callback (the checkpointer's is 1): rankguard's
    #: fit-start checks run before the pre-train save and ``eval_on_startup``.
    priority: ClassVar[int] = 10

    def __init__(self, guards: list[Guard], exchange_timeout_s: float = 300.0) -> None:
        self.runner = GuardRunner(guards, exchange_timeout_s=exchange_timeout_s)
        self.driver = EventDriver(self.runner, self._log_metrics)
        self._train: LoaderFacts | None = None
        self._metrics: dict[str, float] = {}
        self._unhooks: list[Unhook] = []
        self._unhook_load: Unhook | None = None

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
            self._unhooks.append(route_checkpoint_dir_waits(hooks.checkpoint_folder))
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


# -- Public classes: written by tools/generate_api.py from the guard registry; do not edit
# (tests/integrations/test_api.py checks it): run `python tools/generate_api.py` after
# changing a guard's settings or the registry.


class RankGuard(_OlmoCoreAdapter):
    """Every rankguard guard with sound defaults, as an OLMo-core ``Callback``.

    Args:
        exchange_timeout_s: How long a cross-rank check waits for every rank
            before naming the ones that did not arrive (seconds; grows by 5 ms
            per rank with the world size, see ``docs/scale.md``). The hang
            watchdog's own exchanges use its settings.
        **per_guard_config: Per guard, by snake-case name, a dict of its
            settings or ``False`` to leave it out, e.g.
            ``RankGuard(batch_parity_guard={"on_violation": "warn"}, drop_last_guard=False)``.
    """

    @bundle_init(_OlmoCoreAdapter, DEFAULTS)
    def __init__(
        self,
        exchange_timeout_s: float = 300.0,
        *,
        hang_watchdog: dict[str, Any] | bool = True,
        data_consistency_guard: dict[str, Any] | bool = True,
        drop_last_guard: dict[str, Any] | bool = True,
        batch_parity_guard: dict[str, Any] | bool = True,
        shared_dir_barrier: dict[str, Any] | bool = True,
        checkpoint_planner: dict[str, Any] | bool = True,
        data_stall_monitor: dict[str, Any] | bool = True,
        straggler_monitor: dict[str, Any] | bool = True,
    ) -> None:
        """Builds the guards of :class:`RankGuard`."""


class HangWatchdog(_OlmoCoreAdapter):
    """An OLMo-core ``Callback`` for :class:`rankguard.callbacks.HangWatchdog` (same arguments)."""

    @guard_init(_OlmoCoreAdapter, "hang_watchdog", DEFAULTS)
    def __init__(
        self,
        *,
        timeout_s: float | None = None,
        eval_timeout_s: float | None = None,
        post_eval_timeout_s: float | None = None,
        checkpoint_timeout_s: float | None = None,
        first_step_timeout_s: float = 1800.0,
        action: str = "abort",
        abort_at: str = "ceiling",
        report_dir: str = "./rankguard_reports",
        exchange_period_s: float = 10.0,
        auto_calibrate: bool = True,
        warmup_steps: int = 10,
        calibration_factor: float = 10.0,
        floor_s: float = 30.0,
        deadlock_action: str = "abort",
        deadlock_after_s: float = 3.0,
        collective_mismatch: str = "warn",
    ) -> None:
        """Builds the guards of :class:`HangWatchdog`."""


class DataConsistencyGuard(_OlmoCoreAdapter):
    """An OLMo-core ``Callback`` for :class:`rankguard.callbacks.DataConsistencyGuard` (same arguments)."""  # noqa: E501

    @guard_init(_OlmoCoreAdapter, "data_consistency_guard", DEFAULTS)
    def __init__(
        self,
        *,
        on_violation: str = "raise",
        sample_items: int = 16,
        check_content: bool | str = "auto",
        check_rng: bool = True,
    ) -> None:
        """Builds the guards of :class:`DataConsistencyGuard`."""


class DropLastGuard(_OlmoCoreAdapter):
    """An OLMo-core ``Callback`` for :class:`rankguard.callbacks.DropLastGuard` (same arguments)."""

    @guard_init(_OlmoCoreAdapter, "drop_last_guard", DEFAULTS)
    def __init__(
        self,
        *,
        mode: str = "check",
        on_violation: str = "raise",
        warn_eval_padding: bool = True,
    ) -> None:
        """Builds the guards of :class:`DropLastGuard`."""


class BatchParityGuard(_OlmoCoreAdapter):
    """An OLMo-core ``Callback`` for :class:`rankguard.callbacks.BatchParityGuard` (same arguments)."""  # noqa: E501

    @guard_init(_OlmoCoreAdapter, "batch_parity_guard", DEFAULTS)
    def __init__(
        self,
        *,
        on_violation: str = "raise",
        eval_end_timeout_s: float = 120.0,
        check_train: bool = True,
        check_eval: bool = True,
        max_count_samples: int = 1000000,
    ) -> None:
        """Builds the guards of :class:`BatchParityGuard`."""


class SharedDirBarrier(_OlmoCoreAdapter):
    """An OLMo-core ``Callback`` for :class:`rankguard.callbacks.SharedDirBarrier` (same arguments)."""  # noqa: E501

    @guard_init(_OlmoCoreAdapter, "shared_dir_barrier", DEFAULTS)
    def __init__(
        self,
        *,
        on_violation: str = "raise",
        timeout_s: float = 600.0,
        poll_s: float = 0.05,
        probe_wait_s: float = 2.0,
        on_node_local: str = "warn",
    ) -> None:
        """Builds the guards of :class:`SharedDirBarrier`."""


class CheckpointPlanner(_OlmoCoreAdapter):
    """An OLMo-core ``Callback`` for :class:`rankguard.callbacks.CheckpointPlanner` (same arguments)."""  # noqa: E501

    @guard_init(_OlmoCoreAdapter, "checkpoint_planner", DEFAULTS)
    def __init__(
        self,
        *,
        mode: str = "warn",
        materialize: str = "rank0",
        writer: str = "file",
        host_memory_bytes: int | None = None,
        state_dict_type: str = "full",
    ) -> None:
        """Builds the guards of :class:`CheckpointPlanner`."""


class DataStallMonitor(_OlmoCoreAdapter):
    """An OLMo-core ``Callback`` for :class:`rankguard.callbacks.DataStallMonitor` (same arguments)."""  # noqa: E501

    @guard_init(_OlmoCoreAdapter, "data_stall_monitor", DEFAULTS)
    def __init__(
        self,
        *,
        on_violation: str = "warn",
        threshold: float = 0.5,
        window: int = 10,
        interval: int | None = None,
    ) -> None:
        """Builds the guards of :class:`DataStallMonitor`."""


class StragglerMonitor(_OlmoCoreAdapter):
    """An OLMo-core ``Callback`` for :class:`rankguard.callbacks.StragglerMonitor` (same arguments)."""  # noqa: E501

    @guard_init(_OlmoCoreAdapter, "straggler_monitor", DEFAULTS)
    def __init__(
        self,
        *,
        on_violation: str = "warn",
        threshold: float = 0.7,
        window: int = 3,
        interval: int | None = None,
        warmup_steps: int = 20,
        timed_batches: int = 8,
        min_excess_s: float = 0.001,
        min_forward_s: float | None = None,
    ) -> None:
        """Builds the guards of :class:`StragglerMonitor`."""


__all__ = [  # noqa: RUF022
    "checkpoint_to_load",
    "hook_trainer",
    "save_options",
    "BatchParityGuard",
    "CheckpointPlanner",
    "DataConsistencyGuard",
    "DataStallMonitor",
    "DropLastGuard",
    "HangWatchdog",
    "RankGuard",
    "SharedDirBarrier",
    "StragglerMonitor",
]
