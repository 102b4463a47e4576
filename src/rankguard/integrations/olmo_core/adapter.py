"""The OLMo-core adapter: its event map, from OLMo-core ``Callback`` hooks and wrapped methods.

The facts it reads are in :mod:`.facts`, its decisions in :mod:`.decisions`, the
methods it wraps in :mod:`.hooks` and the metric flush's check in :mod:`.flush`.
See docs/integrations.md#olmo-core-where-each-event-comes-from.
"""

from __future__ import annotations

from typing import Any, ClassVar

from olmo_core.train.callbacks import Callback
from olmo_core.train.common import MetricMergeStrategy

# The core guard: the package's own ``SharedDirBarrier`` is the OLMo-core callback of that name.
from rankguard.callbacks.checkpoint.shared_dir_barrier import (
    SharedDirBarrier as CoreSharedDirBarrier,
)
from rankguard.callbacks.core.events import LoaderFacts
from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.core.step_log import OPTIMIZER_STEP
from rankguard.callbacks.hang.stop import StopAgreement
from rankguard.integrations._adapter import Adapter, exit_after_stop
from rankguard.integrations._common import (
    Unhook,
    metric_reduction_check,
)
from rankguard.integrations.olmo_core.decisions import announces_resume
from rankguard.integrations.olmo_core.facts import (
    DEFAULTS,
    SHARDED_SETTING,
    UPLOAD_SETTING,
    eval_facts,
    evaluators,
    resume_facts,
    save_folder,
    save_options,
    sharded_switch,
)
from rankguard.integrations.olmo_core.flush import (
    FLUSH,
    FLUSH_FIX,
    FLUSH_NOTES,
    hook_metric_flush,
)
from rankguard.integrations.olmo_core.hooks import _Hooks, hook_load, trainer_wrappers
from rankguard.integrations.private.olmo_core import attached_trainer, route_checkpoint_dir_waits


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
        #: The preemption agreement (from ``pre_train``, with a hang watchdog).
        self._stop: StopAgreement | None = None

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
        evals = eval_facts(watched)
        guards = self.driver.guards
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
            phases=(OPTIMIZER_STEP,),  # its microbatches' backward passes run unannounced
        )
        check = metric_reduction_check(
            guards, "olmo_core_flush", where=FLUSH, fix=FLUSH_FIX, notes=FLUSH_NOTES
        )
        if check is not None:
            self.add_undo(hook_metric_flush(trainer, check))
        loaded, self._loaded_from = self._loaded_from, None
        if announces_resume(trainer.no_checkpoints, trainer.load_strategy):
            self.driver.resumed(resume_facts(trainer, loaded))  # restored, before any batch
        # After OLMo-core's own SIGTERM/SIGINT handler (installed in fit() just before
        # pre_train; it cancels the run on the rank that got the signal only): the ranks agree
        # first. fit() puts back the handlers it found when it ends.
        self._stop = self.install_stop()

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

    def pre_optim_step(self) -> None:
        """The optimizer steps, in the step log."""
        if self.driver.fitting:
            self.driver.steps.optimizer_step()

    def post_train_batch(self) -> None:
        """TRAIN_BATCH_END (before the checkpointer's save)."""
        if self.driver.fitting:
            self.driver.end_train_batch()

    def post_step(self) -> None:
        """An agreed preemption: at the agreed step every rank cancels the run.

        ``cancel_run(reason, no_sync=True)``, on every rank at one step as OLMo-core asks
        of it, ends the fit after this step; the checkpointer's ``post_train`` then saves
        it; the process exits with 75 when Python exits.
        """
        stop = self._stop
        if stop is not None and stop.requested:
            self._stop_if_agreed(stop)

    def _stop_if_agreed(self, stop: StopAgreement) -> None:
        if stop.stopped is None and stop.at_boundary(self.driver.step):
            assert stop.stopped is not None
            self.trainer.cancel_run(f"rankguard: {stop.stopped.reason}", no_sync=True)
            exit_after_stop(stop, "the checkpointer's save and the code after fit()")

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
