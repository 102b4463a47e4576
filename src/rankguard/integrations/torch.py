"""rankguard for hand-written training loops (plain ``torchrun``, DDP, FSDP2).

Holds ``RankGuard`` (with ``fit`` and ``load``; the run ``fit`` makes, its wrapped loaders
and its save are in ``torch_loop``) and one callback per guard (settings declared in
``rankguard.integrations._api``).
See docs/integrations.md#what-the-wrappers-infer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

from rankguard.callbacks.core.events import LoaderFacts, ResumeFacts
from rankguard.callbacks.core.guard import Guard
from rankguard.integrations import _api
from rankguard.integrations._adapter import Adapter
from rankguard.integrations.torch_loop import (
    EvalLoader,
    Fits,
    Load,
    MetricsFn,
    Run,
    TrainLoader,
    check_dirs,
    check_fit,
    check_iterable,
    eval_facts,
)

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
