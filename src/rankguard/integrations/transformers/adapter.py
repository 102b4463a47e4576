"""The Hugging Face Trainer adapter: ``TrainerCallback`` hooks as rankguard's core events.

Its event map: each hook of :class:`_TrainerAdapter` fires the core events the
Trainer's point brings, through the adapter's driver; the facts come from
:mod:`rankguard.integrations.transformers.facts` and what comes next from
:mod:`rankguard.integrations.transformers.decisions`. The public classes join it to
their settings in ``rankguard.integrations.transformers``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from rankguard.callbacks.core.events import LoaderFacts
from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.core.step_log import BACKWARD_OPTIMIZER_STEP, MICROBATCH
from rankguard.callbacks.hang.stop import StopAgreement
from rankguard.integrations._adapter import Adapter, exit_after_stop
from rankguard.integrations._common import load_guard_state, save_guard_state
from rankguard.integrations.private.transformers import calling_trainer, loop_position
from rankguard.integrations.transformers.decisions import next_event, save_after_eval
from rankguard.integrations.transformers.facts import (
    SHARDED_SETTING,
    SPLIT_DECISIONS,
    checkpoint_folder,
    data_parallel,
    eval_loader_names,
    resume_checkpoint,
    resume_facts,
    state_dict_type,
    stop_decision,
    train_loader,
)

#: The package's name: the logger's as it was when the adapter was one module.
logger = logging.getLogger("rankguard.integrations.transformers")
#: The parts of a train batch (one optimizer step) the Trainer announces: each microbatch at its
#: end, the last with the optimizer step.
PHASES = (MICROBATCH, BACKWARD_OPTIMIZER_STEP)


class _TrainerAdapter(Adapter, TrainerCallback):
    """Drives a :class:`GuardRunner` from ``TrainerCallback`` hooks."""

    def __init__(self, guards: list[Guard], exchange_timeout_s: float = 300.0) -> None:
        super().__init__(guards, exchange_timeout_s)
        self._trainer: Trainer | None = None
        self._train: LoaderFacts | None = None
        self._evals: list[LoaderFacts] = []
        self._eval_source: Any = None
        self._fetch_after_log = False
        self._resume: tuple[str, str | bool] | None = None  # a resume's checkpoint, asked
        #: The watchdog's preemption agreement, caught from ``on_train_begin`` to close.
        self._stop: StopAgreement | None = None

    # -- facts -----------------------------------------------------------------------

    def _eval_loaders(self, eval_dataloader: Any = None) -> list[LoaderFacts]:
        """The eval loaders the Trainer will run, built with its public ``get_eval_dataloader``."""
        trainer = self._trainer
        if trainer is None:  # only the loader of the last eval, if there was one
            return [LoaderFacts("eval", eval_dataloader, False)] if eval_dataloader else []
        if self._evals and trainer.eval_dataset is self._eval_source:
            return self._evals
        self._eval_source = trainer.eval_dataset
        try:
            self._evals = [
                LoaderFacts(name, trainer.get_eval_dataloader(key), is_train=False)
                for name, key in eval_loader_names(trainer.eval_dataset)
            ]
        except Exception as exc:  # a subclass that builds its loaders differently
            logger.info("rankguard: cannot build the eval loaders ahead of eval (%r)", exc)
            self._evals = []
        return self._evals

    def _flush_metrics(self) -> None:
        if self._metrics and self._trainer is not None:
            self._trainer.log(self.take_metrics())

    # -- hooks -----------------------------------------------------------------------

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Wraps the Trainer's ``train`` (see :meth:`_hook_train`)."""
        trainer = calling_trainer()
        if trainer is not None and not self.wrapped:
            self._hook_train(trainer)

    def _hook_train(self, trainer: Trainer) -> None:
        """Wraps ``trainer.train``: a resume checkpoint is announced, an error reaches the guards.

        ``Trainer.train(resume_from_checkpoint=...)`` loads the model, optimizer and
        scheduler before calling any callback hook, and the Trainer has no exception
        hook. Its ``train`` is wrapped on this instance (the public method, its public
        argument; the path as :func:`resume_checkpoint` reads it), so a resume
        checkpoint is checked before it is loaded, and an error is seen where it
        leaves ``train``, before the caller's ``finally`` (a teardown that may wait).
        ``tests/integrations/test_transformers.py`` fails if ``train`` stops taking
        ``resume_from_checkpoint``.
        """
        signature = inspect.signature(trainer.train)

        def make(train: Callable[..., Any]) -> Callable[..., Any]:
            def train_resuming(*args: Any, **kwargs: Any) -> Any:
                try:
                    called = signature.bind_partial(*args, **kwargs).arguments
                except TypeError:  # train itself will say what is wrong with the call
                    called = {}
                resume = called.get("resume_from_checkpoint")
                if resume:  # None or False: a fresh start
                    path = resume_checkpoint(trainer.args, resume)
                    self._resume = (os.path.dirname(path), resume)
                    self.driver.load_start(path)
                try:
                    return train(*args, **kwargs)
                except BaseException as exc:  # as Adapter.watch_raise, in the one frame
                    try:
                        self.fail(exc)
                    finally:
                        self.close()
                    raise

            return train_resuming

        self.wrap(trainer, "train", make)

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Any = None,
        optimizer: Any = None,
        train_dataloader: Any = None,
        **kwargs: Any,
    ) -> None:
        """FIT_START with the train loader, the eval loaders, the model and optimizer."""
        if self.driver.fitting:  # the Trainer restarted its loop (auto_find_batch_size)
            self.driver.abandon()
        self._trainer = calling_trainer()
        if self._trainer is None:
            logger.info(
                "rankguard: no Trainer found calling the callback; eval loaders are checked "
                "from the second evaluation on"
            )
        self._train = train_loader(train_dataloader)
        evals = self._eval_loaders() if args.eval_strategy != "no" or args.eval_on_start else []
        dirs = [str(args.output_dir)] if args.save_strategy != "no" else []
        if self._resume:  # the guards' state saved with the checkpoint (see on_save)
            load_guard_state(self.driver, self._resume[0])
        self.driver.fit_start(
            loaders=([self._train] if self._train else []) + evals,
            model=model,
            optimizer=optimizer,
            data_parallel=data_parallel(self._trainer),
            directories=dirs,
            state_dict_type=state_dict_type(self._trainer),
            switch_to_sharded=None,
            sharded_setting=SHARDED_SETTING,
            decision_probe=functools.partial(stop_decision, control),
            split_decisions=SPLIT_DECISIONS,
            phases=PHASES,
        )
        if args.eval_on_start and evals:
            self.driver.eval_start(evals)
        # rankguard catches the preemption signals during the fit: in place of the JIT
        # checkpoint's SIGTERM handler, when it is on (docs/hang.md#lightning-and-the-hf-trainer).
        self._stop = self.install_stop()

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """EPOCH_START, then the epoch's first fetch."""
        if self.driver.fitting:
            if self.driver.saving:  # a "best" save that did not happen
                self.driver.save_end()
            self.driver.epoch_start(self._train)
            self.driver.fetch_start()

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """DATA_FETCH_END, TRAIN_BATCH_START; logs the guards' metrics."""
        driver = self.driver
        if driver.fitting:
            self._fetch_after_log = False
            if driver.saving:  # a "best" save that did not happen
                driver.save_end()
            if self._resume is not None:  # the batch is fetched: an error here is no loader's
                driver.fetch_end()
                self._resumed(args, state)
                driver.train_batch_start()
            elif driver.fetching and not driver.batch_open:
                # The usual step, as EventDriver.fetch_end_batch_start's first branch makes
                # it: the driver's two flags, then the step log's one entry. A frame fewer
                # (about 1 us here, on the cache the backward left cold, every step).
                driver.fetching, driver.batch_open = False, True
                driver.steps.fetch_end_batch_start(driver.step)
            else:
                driver.fetch_end_batch_start()
            if self._metrics:  # at most once an interval (Adapter.buffer_metrics's)
                self._flush_metrics()

    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """A microbatch's backward ran, its window goes on (gradient accumulation), in the log."""
        self.driver.steps.microbatch()

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The window's last backward ran; the optimizer steps, in the step log."""
        self.driver.steps.backward_optimizer_step()

    def _resumed(self, args: TrainingArguments, state: TrainerState) -> None:
        """RESUMED, at the resumed train's first ``on_step_begin``.

        Where the Trainer (transformers 4.57 and 5) has restored everything: the
        checkpoint and counters in ``train``, the data position (``skip_first_batches``),
        and each rank's random state (``_load_rng_state``: after ``on_epoch_begin``, or
        after the first batch is fetched where it skips batches, ``rng_to_sync``).
        """
        asked = self._resume or ("", False)
        self._resume = None
        self.driver.resumed(resume_facts(args, state, asked, loop_position(), self._train))

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """TRAIN_BATCH_END, then what the Trainer does next: eval, save, log or fetch.

        After a preemption's agreed step: the save (where the user saves) and the end.
        """
        driver = self.driver
        if driver.fitting:
            if not (control.should_evaluate or control.should_save or control.should_log):
                if driver.batch_open and not driver.fetching:
                    # The usual step, as EventDriver.fetch_start's first branch makes it
                    # (see on_step_begin): the batch ends and the next fetch starts.
                    driver.batch_open, driver.fetching = False, True
                    driver.step = step = driver.step + 1
                    driver.steps.batch_end_fetch_start(step - 1, fetch_step=step)
                else:
                    driver.fetch_start()
                stop = self._stop  # a preemption: every rank ends after the agreed step
                if stop is not None and stop.requested and self._stop_here(stop, args, control):
                    driver.save_start([checkpoint_folder(args, state)], model=None)
                return
            driver.end_train_batch()
            stop = self._stop
            if stop is not None and stop.requested:
                self._stop_here(stop, args, control)
            self._next(args, state, control, kwargs.get("eval_dataloader"), after_step=True)

    def _stop_here(
        self, stop: StopAgreement, args: TrainingArguments, control: TrainerControl
    ) -> bool:
        """Ends training if this is the agreed step; returns whether a save comes first.

        The Trainer saves (``checkpoint-N``) where the user saves (``save_strategy``) or
        turned on the JIT checkpoint on SIGTERM (transformers 5), whose save this is.
        """
        if not stop.at_boundary(self.driver.step):
            return False
        control.should_training_stop = True
        saves = args.save_strategy != "no" or bool(getattr(args, "enable_jit_checkpoint", False))
        control.should_save = control.should_save or saves
        return saves

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """EPOCH_END; then EVAL_START or CHECKPOINT_SAVE_START when the epoch's end brings one."""
        if self.driver.fitting:
            self.driver.epoch_end(self._train)
            if self._stop is not None and self._stop.stopped is not None:
                # preempted: the save came with the agreed step; no eval or second save now
                control.should_evaluate = control.should_save = False
            self._next(args, state, control, kwargs.get("eval_dataloader"), after_step=False)

    def _next(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        eval_dataloader: Any,
        after_step: bool,
    ) -> None:
        """Announces :func:`next_event`."""
        event = next_event(control, after_step)
        if event == "eval":
            evals = self._eval_loaders(eval_dataloader)
            if evals:
                self.driver.eval_start(evals)
        elif event == "save":
            self.driver.save_start([checkpoint_folder(args, state)], model=None)
        elif event == "log":
            self._fetch_after_log = True  # the Trainer gathers the loss first
        elif event == "fetch":
            self.driver.fetch_start()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        """DATA_FETCH_START once the step's log (a loss gather over ranks) is done."""
        if self._fetch_after_log and self.driver.fitting:
            self._fetch_after_log = False
            self.driver.fetch_start()
        if self._trainer is None and logs is not None and self._metrics:
            logs.update(self.take_metrics())

    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """EVAL_BATCH_END of an eval rankguard started (not ``predict`` or a later ``evaluate``)."""
        if self.driver.fitting and self.driver.evals:
            self.driver.eval_batch_end()

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """EVAL_END of the current eval loader; after the last, the save if one is due."""
        if not (self.driver.fitting and self.driver.evals):
            return
        self.driver.eval_end()
        if self.driver.evals:
            return
        save = save_after_eval(control, args)
        if save is not None:
            folder = checkpoint_folder(args, state) if save == "step" else args.output_dir
            self.driver.save_start([str(folder)], model=None)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The guards' state into the checkpoint (the save's exchange is done); SAVE_END."""
        if self.driver.fitting and self.driver.saving:
            if args.should_save:  # the Trainer keeps no callback state of its own
                save_guard_state(self.driver, checkpoint_folder(args, state))
            self.driver.save_end()
            self.driver.fetch_start()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """FIT_END; then the guards stop."""
        if not self.driver.fitting:
            return
        if self.driver.saving:
            self.driver.save_end()
        try:
            self.driver.fit_end()
            self._flush_metrics()
        finally:
            self.close()

    def close(self) -> None:
        """Stops every guard; safe to call twice and after an error.

        An error that leaves ``train()`` stops them (see :meth:`_hook_train`); a
        Trainer whose ``train`` was not wrapped (no ``on_init_end``) calls no hook
        when it raises: in a process that lives on (a notebook), call this. The
        wrapper stays: the Trainer may train again (a resume), and ``on_init_end``
        runs once per Trainer.
        """
        self.driver.fitting = False
        self._trainer = None
        self._resume = None
        self._evals = []
        self._eval_source = None
        self.driver.close()
        stop, self._stop = self._stop, None  # after a preemption: exit 75 when Python exits
        exit_after_stop(stop, "your code that follows `trainer.train(...)`")
