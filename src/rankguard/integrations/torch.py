"""rankguard for hand-written training loops (plain ``torchrun``, DDP, FSDP2).

Holds ``RankGuard`` (with ``fit`` and ``load``; the wrapped loaders are in ``torch_loop``) and one
callback per guard (settings declared in ``rankguard.integrations._api``).
See docs/integrations.md#what-the-wrappers-infer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any

from rankguard.callbacks.core.events import LoaderFacts, ResumeFacts
from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.hang.stop import STOP_EXIT_CODE
from rankguard.integrations import _api
from rankguard.integrations._adapter import Adapter, exit_after_stop
from rankguard.integrations.torch_loop import (
    ORDER,
    EvalLoader,
    Fit,
    Fits,
    Load,
    Save,
    TrainLoader,
    check_dirs,
    check_eval,
    check_fit,
    check_iterable,
    eval_facts,
)
from rankguard.integrations.torch_phases import announce_phases

#: What a hand-written loop changes to save sharded checkpoints, named in rankguard's messages.
SHARDED_SETTING = (
    "torch.distributed.checkpoint.save({'model': model_sd, 'optim': optim_sd}, "
    "checkpoint_id=folder) with the sharded state dicts of "
    "torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer), and "
    "guard.fit(..., state_dict_type='sharded')"
)

MetricsFn = Callable[[dict[str, float]], Any]

logger = logging.getLogger("rankguard.integrations.torch")


class _LoopGuard(Adapter):
    """Drives the guards from a hand-written loop (one driver for every fit).

    What it infers: docs/integrations.md#what-the-wrappers-infer.
    """

    def __init__(self, guards: list[Guard], exchange_timeout_s: float = 300.0) -> None:
        super().__init__(guards, exchange_timeout_s)
        self._fits = Fits()  # the fit running and the resume the next one compares

    def fit(
        self,
        model: Any = None,
        optimizer: Any = None,
        train_loader: Iterable[Any] | None = None,
        *,
        eval_loaders: Iterable[Any] | Mapping[str, Iterable[Any]] | None = None,
        save_dirs: str | os.PathLike | Iterable[str | os.PathLike] | None = None,
        state_dict_type: str | None = None,
        log_metrics: MetricsFn | None = None,
    ) -> Run:
        """One fit of the loop, as a context manager: ``with guard.fit(...) as run:``.

        Entering it runs the fit-start checks (before any batch) on every rank;
        leaving it ends the fit (or, on an error, lets the guards explain it)
        and stops the guards.

        Args:
            model: The model being trained (DDP, FSDP2 or plain), for the
                checkpoint memory plan and the replica check (pass the DDP-wrapped
                model: its process group says which ranks are replicas).
            optimizer: Its optimizer, for the plan (and its step count, for the
                replica check).
            train_loader: The train loader (also the default of :meth:`Run.train`).
            eval_loaders: The eval loaders, by name (a single loader is named
                ``"eval"``), compared at fit start and before each eval.
            save_dirs: The directories checkpoints are saved into (the default
                of :meth:`Run.checkpoint`); made visible to every rank at fit start.
            state_dict_type: What the loop's saves write: ``"full"`` (one
                consolidated file) or ``"sharded"`` (a shard per rank); default:
                the ``CheckpointPlanner``'s ``state_dict_type`` setting.
            log_metrics: Called with the guards' metrics (``rankguard/...`` keys),
                e.g. your logger's ``log``; the latest values are also in
                :attr:`Run.metrics`.

        Returns:
            The run (enter it with ``with``).

        Raises:
            ValueError: An argument of the wrong kind.
        """
        check_fit(model, optimizer, state_dict_type, log_metrics)
        train = None
        if train_loader is not None:
            train = LoaderFacts("train", check_iterable("train_loader", train_loader), True)
        return Run(
            self,
            self._fits,
            model=model,
            optimizer=optimizer,
            train=train,
            evals=eval_facts(eval_loaders),
            save_dirs=check_dirs(save_dirs),
            state_dict_type=state_dict_type,
            log_metrics=log_metrics,
        )

    def load(self, path: str | os.PathLike) -> Load:
        """A context manager around loading a checkpoint, entered on every rank.

        On entry every rank checks that every node sees ``path`` (the file or
        folder the loop is about to read) before any rank reads it: a
        checkpoint that exists on some nodes only (a node-local disk) is a
        ``NodeLocalDirError`` on every rank naming the nodes without it, instead
        of a load error on those ranks while the others wait in the next
        collective. Use it for a resume, before ``guard.fit(...)`` (where the
        model is often built from the checkpoint), or inside the fit::

            with guard.load(ckpt_path):
                state = torch.load(ckpt_path)

        Args:
            path: The checkpoint file or folder (the same on every rank); a
                remote URI (``s3://...``) is not checked.

        Raises:
            ValueError: ``path`` is not a path.
        """
        if not isinstance(path, str | os.PathLike) or not str(path):
            raise ValueError(f"`path` must be a checkpoint file or folder path; got {path!r}.")
        return Load(self, self._fits, os.fspath(path))

    def resumed(
        self,
        checkpoint: str | os.PathLike | None,
        *,
        step: int,
        epoch: int = 0,
        state: Mapping[str, Any] | None = None,
        restores_rng: bool = False,
        folder: str | os.PathLike | None = None,
        **counters: int,
    ) -> None:
        """Tells the guards what this rank resumed from; call it on every rank before ``fit``.

        The next ``guard.fit(...)`` compares every rank's resume before its first
        batch (:class:`~rankguard.callbacks.ResumeGuard`): the checkpoint, the
        counters, the train loader's position and the random states::

            path = latest_checkpoint(save_dir)  # None where this rank finds none
            state = torch.load(path) if path else {}
            guard.resumed(path, step=state.get("step", 0), state=state.get("rankguard"))
            with guard.fit(model, optimizer, train_loader) as run: ...

        Args:
            checkpoint: The file or folder this rank loaded; ``None`` where it found
                none and starts fresh.
            step: The step the loop goes on from, as restored.
            epoch: The epoch it goes on in, as restored.
            state: What :meth:`state_dict` returned when the checkpoint was saved.
            restores_rng: Whether the loop restored this rank's random states from the
                checkpoint (then they must show the pattern they had at the save).
            folder: Where the loop looked for the checkpoint (its save folder): the
                checkpoint's path in it is its name in messages, and what each node
                sees there is compared. Default: the checkpoint's parent.
            **counters: Other counters the loop restored, e.g. ``batch_in_epoch=3``.
        """
        if state:
            self.driver.load_state_dict(state)
        self._fits.resume = ResumeFacts(
            asked="guard.resumed(...)",
            checkpoint=None if checkpoint is None else os.fspath(checkpoint),
            counters={"step": int(step), "epoch": int(epoch), **counters},
            restores_rng=bool(restores_rng),
            folder=None if folder is None else os.fspath(folder),
        )

    def close(self) -> None:
        """Stops every guard; safe to call twice and after an error."""
        self.stop()


class Run:
    """One fit of a hand-written loop; made by ``guard.fit(...)``, used inside ``with``.

    A preemption signal (``HangWatchdog``'s ``stop_signals``, SIGTERM by default) on
    any rank ends every rank's ``run.train(...)`` pass after one agreed step:
    :attr:`stopped` says why; the loop's code after it (a save) runs on every rank;
    the process then exits with :attr:`exit_code` (75) when Python exits, after the
    code that follows the ``with`` block (docs/hang.md#preemption-every-rank-stops-at-one-step)::

        with guard.fit(model, optimizer, loader) as run:
            for epoch in range(epochs):
                for batch in run.train(loader):
                    ...
                if run.stopped:  # preempted: every rank is here, after the same step
                    break
            save(model, optimizer, run.step)

    Attributes:
        metrics: The latest value of each metric the guards logged.
    """

    def __init__(
        self,
        guard: _LoopGuard,
        fits: Fits,
        *,
        model: Any,
        optimizer: Any,
        train: LoaderFacts | None,
        evals: dict[str, LoaderFacts],
        save_dirs: list[str],
        state_dict_type: str | None,
        log_metrics: MetricsFn | None,
    ) -> None:
        self._guard = guard
        self._fits = fits
        self._fit = Fit(guard.driver, model)  # what the wrapped loaders and save share
        self._optimizer = optimizer
        self._train = train
        self._evals = evals
        self._save_dirs = save_dirs
        self._state_dict_type = state_dict_type
        self._user_metrics = log_metrics
        self.metrics: dict[str, float] = {}
        self._unannounce: Callable[[], None] = _nothing  # the backward passes' announcement

    @property
    def stopped(self) -> str | None:
        """Why every rank's training stopped early, or ``None``.

        E.g. ``"preempted by SIGTERM on rank 1 at step 812"``: every rank's
        ``run.train(...)`` ended after train step 812, and any later pass yields no batch.
        """
        stop = self._fit.stop
        stopped = stop.stopped if stop is not None else None
        return stopped.reason if stopped is not None else None

    @property
    def exit_code(self) -> int | None:
        """The code the process exits with when Python exits: 75 after a preemption, else None."""
        return STOP_EXIT_CODE if self.stopped is not None else None

    @property
    def step(self) -> int:
        """Train batches done in this fit (the one in the loop body counts once it started)."""
        driver = self._fit.driver
        return driver.step + int(driver.batch_open)

    @property
    def epoch(self) -> int:
        """Passes over the train loader started in this fit, minus one (-1 before the first)."""
        return self._fit.driver.epoch

    def _log_metrics(self, metrics: Mapping[str, float]) -> None:
        self.metrics.update(metrics)
        if self._user_metrics is not None:
            self._user_metrics(dict(metrics))

    # -- the fit ---------------------------------------------------------------------

    def __enter__(self) -> Run:
        fit = self._fit
        if fit.state != "new":
            raise RuntimeError(
                "This `guard.fit(...)` was already entered; call `guard.fit(...)` again for a "
                f"new fit. {ORDER}"
            )
        if self._fits.running is not None:
            raise RuntimeError(
                "`guard.fit(...)` entered while an earlier fit of this RankGuard is still "
                f"running (fits do not nest): leave the first `with` block first. {ORDER}"
            )
        self._fits.running = fit
        fit.state = "active"
        fit.driver.log_metrics = self._log_metrics
        loaders = ([self._train] if self._train else []) + list(self._evals.values())
        try:
            phases: tuple[str, ...] = ()
            if self._guard.reads_phases:  # the hang watchdog's history reads them
                steps = self._guard.driver.steps
                phases, self._unannounce = announce_phases(steps, self._optimizer)
            fit.driver.fit_start(
                loaders=loaders,
                model=fit.model,
                optimizer=self._optimizer,
                directories=self._save_dirs,
                state_dict_type=self._state_dict_type,
                switch_to_sharded=None,
                sharded_setting=SHARDED_SETTING,
                phases=phases,
            )
            fit.stop = self._guard.install_stop()  # its train pass ends on the agreed step
            resume, self._fits.resume = self._fits.resume, None
            if resume is not None:
                resume.loader = self._train.loader if self._train else None
                fit.driver.resumed(resume)
        except BaseException as exc:
            self._end(exc)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            self._end(exc)
            return
        fit = self._fit
        try:
            fit.close_eval()
            fit.close_epoch()
            fit.driver.fit_end()
        except BaseException as error:
            self._end(error)
            raise
        self._end(None)

    def _end(self, exc: BaseException | None) -> None:
        self._unannounce()
        fit = self._fit
        fit.state = "ended"
        self._fits.running = None
        fit.save = None
        fit.train_pass = None
        try:
            if exc is None:
                self._guard.driver.close()
            else:
                self._guard.fail(exc)
        finally:
            self._exit_if_stopped()

    def _exit_if_stopped(self) -> None:
        """After a preemption: exit with 75 once the code after the block ran (at Python exit)."""
        exit_after_stop(self._fit.stop, "your code that follows the `with guard.fit(...)` block")

    # -- train -----------------------------------------------------------------------

    def train(self, loader: Iterable[Any] | None = None) -> TrainLoader:
        """The train loader, wrapped: iterate it once per epoch, as you would the loader.

        Args:
            loader: The train loader (default: the one given to ``guard.fit``).

        Returns:
            An iterable with the loader's ``len()``.
        """
        if loader is None:
            if self._train is None:
                raise ValueError(
                    "`run.train()` needs the train loader: pass it here or to `guard.fit(...)`."
                )
            loader = self._train.loader
        return TrainLoader(self._fit, check_iterable("loader", loader))

    # -- eval ------------------------------------------------------------------------

    def eval(
        self, loader: Iterable[Any], *, name: str | None = None, max_batches: int | None = None
    ) -> EvalLoader:
        """An eval loader, wrapped: iterate it once per evaluation.

        Args:
            loader: The eval loader.
            name: Its name in messages and cross-rank checks (default: its key in
                ``guard.fit(eval_loaders=...)``, else ``"eval"``).
            max_batches: Stop after this many batches (the plan the checks use);
                leaving the loop early with ``break`` works too, and the batches
                that ran are compared across ranks.

        Returns:
            An iterable with the loader's ``len()`` (capped by ``max_batches``).
        """
        check_eval(loader, name, max_batches)
        if name is None:
            name = next((n for n, f in self._evals.items() if f.loader is loader), "eval")
        facts = LoaderFacts(name, loader, is_train=False, num_batches=max_batches)
        return EvalLoader(self._fit, facts)

    # -- checkpoint ------------------------------------------------------------------

    def checkpoint(self, *directories: str | os.PathLike) -> Save:
        """A context manager around one save, entered on every rank.

        On entry every rank sees ``directories`` (created where missing, on the
        right ranks, see ``SharedDirBarrier``) before any rank writes, and the
        hang watchdog applies its checkpoint deadline until the block ends.

        Args:
            *directories: The directories this save writes into (not file
                names); default: ``save_dirs`` of ``guard.fit``.
        """
        dirs = check_dirs(list(directories)) if directories else list(self._save_dirs)
        return Save(self._fit, dirs)


def _nothing() -> None:
    """Undoes nothing (no announcement was made)."""


class RankGuard(_api.RankGuardSettings, _LoopGuard):
    """Every rankguard guard with sound defaults, as a hand-written loop's guard (``guard.fit``)."""


class HangWatchdog(_api.HangWatchdogSettings, _LoopGuard):
    """The hang watchdog, as a hand-written loop's guard (``guard.fit``)."""


class DataConsistencyGuard(_api.DataConsistencyGuardSettings, _LoopGuard):
    """The data consistency guard, as a hand-written loop's guard (``guard.fit``)."""


class DropLastGuard(_api.DropLastGuardSettings, _LoopGuard):
    """The drop-last guard, as a hand-written loop's guard (``guard.fit``)."""


class BatchParityGuard(_api.BatchParityGuardSettings, _LoopGuard):
    """The batch parity guard, as a hand-written loop's guard (``guard.fit``)."""


class SharedDirBarrier(_api.SharedDirBarrierSettings, _LoopGuard):
    """The shared-directory barrier, as a hand-written loop's guard (``guard.fit``)."""


class ResumeGuard(_api.ResumeGuardSettings, _LoopGuard):
    """The resume check, as a hand-written loop's guard (``guard.fit``)."""


class ReplicaGuard(_api.ReplicaGuardSettings, _LoopGuard):
    """The replica check, as a hand-written loop's guard (``guard.fit``)."""


class CheckpointPlanner(_api.CheckpointPlannerSettings, _LoopGuard):
    """The checkpoint planner, as a hand-written loop's guard (``guard.fit``)."""


class DataStallMonitor(_api.DataStallMonitorSettings, _LoopGuard):
    """The data stall monitor, as a hand-written loop's guard (``guard.fit``)."""


class StragglerMonitor(_api.StragglerMonitorSettings, _LoopGuard):
    """The straggler monitor, as a hand-written loop's guard (``guard.fit``)."""


__all__ = ["EvalLoader", "Run", "TrainLoader", *_api.CLASS_NAMES]
