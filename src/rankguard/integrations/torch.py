"""rankguard for hand-written training loops (plain ``torchrun``, DDP, FSDP2).

Holds ``RankGuard`` (with ``fit``, ``load`` and the ``run`` wrappers) and one
callback per guard (written by ``tools/generate_api.py``).
See docs/integrations.md#what-the-wrappers-infer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any

from rankguard.callbacks.core.events import LoaderFacts, LoaderPass
from rankguard.callbacks.core.guard import Guard, GuardRunner
from rankguard.integrations._common import bundle_init, guard_init
from rankguard.integrations._driver import EventDriver

logger = logging.getLogger(__name__)

#: What a hand-written loop changes to save sharded checkpoints, named in rankguard's messages.
SHARDED_SETTING = (
    "torch.distributed.checkpoint.save({'model': model_sd, 'optim': optim_sd}, "
    "checkpoint_id=folder) with the sharded state dicts of "
    "torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer), and "
    "guard.fit(..., state_dict_type='sharded')"
)
ORDER = (
    "Expected order: `with guard.fit(...) as run:` once, then inside it `for batch in "
    "run.train(loader)`, `for batch in run.eval(loader)` and `with run.checkpoint(dir):` "
    "(one at a time, on every rank)."
)
STATE_DICT_TYPES = ("full", "sharded")

MetricsFn = Callable[[dict[str, float]], Any]


def _check_iterable(name: str, loader: Any) -> Any:
    if not isinstance(loader, Iterable):
        raise ValueError(f"`{name}` must be an iterable of batches (a DataLoader); got {loader!r}.")
    return loader


def _check_dirs(save_dirs: Any) -> list[str]:
    if save_dirs is None:
        return []
    if isinstance(save_dirs, str | os.PathLike):
        save_dirs = [save_dirs]
    if isinstance(save_dirs, Iterable):
        save_dirs = list(save_dirs)
    if not isinstance(save_dirs, list) or not all(
        isinstance(d, str | os.PathLike) and str(d) for d in save_dirs
    ):
        raise ValueError(
            f"`save_dirs` must be a directory path or a list of them; got {save_dirs!r}."
        )
    return [os.fspath(d) for d in save_dirs]


def _eval_facts(eval_loaders: Any) -> dict[str, LoaderFacts]:
    if eval_loaders is None:
        return {}
    if not isinstance(eval_loaders, Mapping):
        eval_loaders = {"eval": eval_loaders}
    facts = {}
    for name, loader in eval_loaders.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"`eval_loaders` names must be non-empty strings; got {name!r}.")
        facts[name] = LoaderFacts(name, _check_iterable(f"eval_loaders[{name!r}]", loader), False)
    return facts


class _LoopGuard:
    """Drives a :class:`GuardRunner` from a hand-written loop.

    What it infers: docs/integrations.md#what-the-wrappers-infer.
    """

    def __init__(self, guards: list[Guard], exchange_timeout_s: float = 300.0) -> None:
        self.runner = GuardRunner(guards, exchange_timeout_s=exchange_timeout_s)
        self._running: Run | None = None

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
                checkpoint memory plan.
            optimizer: Its optimizer, for the plan.
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
        if state_dict_type is not None and state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(
                f"`state_dict_type` must be one of 'full', 'sharded' or None; got "
                f"{state_dict_type!r}."
            )
        if optimizer is not None and not hasattr(optimizer, "param_groups"):
            raise ValueError(f"`optimizer` must be a torch optimizer or None; got {optimizer!r}.")
        if model is not None and not hasattr(model, "parameters"):
            raise ValueError(f"`model` must be a torch.nn.Module or None; got {model!r}.")
        if log_metrics is not None and not callable(log_metrics):
            raise ValueError(f"`log_metrics` must be callable or None; got {log_metrics!r}.")
        train = None
        if train_loader is not None:
            train = LoaderFacts("train", _check_iterable("train_loader", train_loader), True)
        return Run(
            self,
            model=model,
            optimizer=optimizer,
            train=train,
            evals=_eval_facts(eval_loaders),
            save_dirs=_check_dirs(save_dirs),
            state_dict_type=state_dict_type,
            log_metrics=log_metrics,
        )

    def load(self, path: str | os.PathLike) -> _Load:
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
        return _Load(self, os.fspath(path))

    def state_dict(self) -> dict[str, Any]:
        """What the guards keep across a restart (plain values), to save with a checkpoint.

        Today the hang watchdog's calibration: save it with the model, and a
        resumed job starts with calibrated deadlines from its first step::

            torch.save({"model": ..., "rankguard": guard.state_dict()}, path)
        """
        return self.runner.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what :meth:`state_dict` saved; call it before ``guard.fit(...)``.

        Args:
            state: A dict :meth:`state_dict` returned (an empty one is fine).
        """
        self.runner.load_state_dict(state)

    def close(self) -> None:
        """Stops every guard; safe to call twice and after an error."""
        self.runner.close()


class _Load:
    """The context manager of :meth:`_LoopGuard.load`."""

    def __init__(self, guard: _LoopGuard, path: str) -> None:
        self._guard = guard
        self.path = path
        self._outside_fit = False

    def __enter__(self) -> _Load:
        run = self._guard._running
        if run is not None:
            run._require("guard.load(...)")
            run._driver.load_start(self.path)
            return self
        self._outside_fit = True
        try:
            EventDriver(self._guard.runner).load_start(self.path)
        except BaseException:
            self._guard.runner.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._outside_fit:  # the fit that follows starts the guards afresh
            self._outside_fit = False
            self._guard.runner.close()


class Run:
    """One fit of a hand-written loop; made by ``guard.fit(...)``, used inside ``with``.

    Attributes:
        metrics: The latest value of each metric the guards logged.
    """

    def __init__(
        self,
        guard: _LoopGuard,
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
        self._model = model
        self._optimizer = optimizer
        self._train = train
        self._evals = evals
        self._save_dirs = save_dirs
        self._state_dict_type = state_dict_type
        self._user_metrics = log_metrics
        self.metrics: dict[str, float] = {}
        self._driver = EventDriver(guard.runner, self._log_metrics)
        self._state = "new"  # new -> active -> ended
        self._eval: _EvalIterator | None = None
        self._pass: _TrainIterator | None = None
        self._save: _Save | None = None
        self._left_early: set[str] = set()

    @property
    def step(self) -> int:
        """Train batches done in this fit (the one in the loop body counts once it started)."""
        return self._driver.step + int(self._driver.batch_open)

    @property
    def epoch(self) -> int:
        """Passes over the train loader started in this fit, minus one (-1 before the first)."""
        return self._driver.epoch

    def _log_metrics(self, metrics: Mapping[str, float]) -> None:
        self.metrics.update(metrics)
        if self._user_metrics is not None:
            self._user_metrics(dict(metrics))

    # -- the fit ---------------------------------------------------------------------

    def __enter__(self) -> Run:
        if self._state != "new":
            raise RuntimeError(
                "This `guard.fit(...)` was already entered; call `guard.fit(...)` again for a "
                f"new fit. {ORDER}"
            )
        running = self._guard._running
        if running is not None:
            raise RuntimeError(
                "`guard.fit(...)` entered while an earlier fit of this RankGuard is still "
                f"running (fits do not nest): leave the first `with` block first. {ORDER}"
            )
        self._guard._running = self
        self._state = "active"
        loaders = ([self._train] if self._train else []) + list(self._evals.values())
        try:
            self._driver.fit_start(
                loaders=loaders,
                model=self._model,
                optimizer=self._optimizer,
                directories=self._save_dirs,
                state_dict_type=self._state_dict_type,
                switch_to_sharded=None,
                sharded_setting=SHARDED_SETTING,
            )
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
        try:
            self._close_eval()
            self._close_epoch()
            self._driver.fit_end()
        except BaseException as error:
            self._end(error)
            raise
        self._end(None)

    def _end(self, exc: BaseException | None) -> None:
        self._state = "ended"
        self._guard._running = None
        self._save = None
        self._pass = None
        if exc is None:
            self._guard.runner.close()
        else:
            self._driver.abandon(exc)

    def _require(self, call: str) -> None:
        if self._state != "active":
            when = (
                "before its `with guard.fit(...)` block"
                if self._state == "new"
                else "after its `with guard.fit(...)` block ended"
            )
            raise RuntimeError(f"`{call}` used {when}. {ORDER}")
        if self._save is not None:
            raise RuntimeError(
                f"`{call}` used inside `with run.checkpoint(...)`: a save ends before the next "
                f"train batch or eval starts. {ORDER}"
            )

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
        return TrainLoader(self, _check_iterable("loader", loader))

    def _close_epoch(self) -> None:
        """EPOCH_END of the last train pass, with what its iterator did (next epoch, fit end).

        Not at ``StopIteration``: a rank whose loader ran out first would wait in
        the check while the others still run batches (and a loop that stops every
        rank when one runs out, or DDP's ``join``, still needs it in collectives).
        """
        it, self._pass = self._pass, None
        if it is not None:
            self._driver.epoch_end(it.facts, LoaderPass(it.yielded, it.exhausted))

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
        _check_iterable("loader", loader)
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"`name` must be a non-empty string or None; got {name!r}.")
        if max_batches is not None and (
            isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1
        ):
            raise ValueError(f"`max_batches` must be an integer >= 1 or None; got {max_batches!r}.")
        if name is None:
            name = next((n for n, f in self._evals.items() if f.loader is loader), "eval")
        return EvalLoader(self, LoaderFacts(name, loader, is_train=False, num_batches=max_batches))

    def _close_eval(self) -> None:
        """Ends an eval the loop left early, with the batches that ran as its plan."""
        it = self._eval
        if it is None:
            return
        name = it.facts.name
        if name not in self._left_early:
            self._left_early.add(name)
            logger.info(
                "rankguard: the loop left eval %r after %d batches; the batches that ran are "
                "compared across ranks (`run.eval(loader, max_batches=N)` also checks the plan "
                "before the first batch)",
                name,
                it.started,
            )
        it.finish(early=True)

    # -- checkpoint ------------------------------------------------------------------

    def checkpoint(self, *directories: str | os.PathLike) -> _Save:
        """A context manager around one save, entered on every rank.

        On entry every rank sees ``directories`` (created where missing, on the
        right ranks, see ``SharedDirBarrier``) before any rank writes, and the
        hang watchdog applies its checkpoint deadline until the block ends.

        Args:
            *directories: The directories this save writes into (not file
                names); default: ``save_dirs`` of ``guard.fit``.
        """
        dirs = _check_dirs(list(directories)) if directories else list(self._save_dirs)
        return _Save(self, dirs)


class TrainLoader:
    """The train loader wrapped by :meth:`Run.train`; one iteration is one epoch."""

    def __init__(self, run: Run, loader: Iterable[Any]) -> None:
        self._run = run
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        run = self._run
        run._require("run.train(...)")
        run._close_eval()
        run._close_epoch()
        driver = run._driver
        facts = LoaderFacts("train", self.loader, is_train=True)
        driver.epoch_start(facts)
        run._pass = _TrainIterator(run, facts, driver.epoch)
        return run._pass


class _TrainIterator:
    """One epoch's pass over the train loader: what it returned, and whether it ran out."""

    def __init__(self, run: Run, facts: LoaderFacts, epoch: int) -> None:
        self._run = run
        self.facts = facts
        self._iterator = iter(facts.loader)
        self._epoch = epoch
        self.yielded = 0
        self.exhausted = False

    def __iter__(self) -> _TrainIterator:
        return self

    def __next__(self) -> Any:
        run = self._run
        driver = run._driver
        if run._state != "active" or run._save is not None:  # once a batch: checks inlined
            run._require("run.train(...)")
        if driver.epoch != self._epoch:
            raise RuntimeError(
                f"A `run.train(...)` iterator of epoch {self._epoch} used after epoch "
                f"{driver.epoch} started: iterate `run.train(loader)` once per epoch. {ORDER}"
            )
        if run._eval is not None:
            run._close_eval()
        driver.fetch_start()
        try:
            batch = next(self._iterator)
        except StopIteration:  # the epoch ends at the next epoch start or the fit's end
            self.exhausted = True
            raise
        self.yielded += 1
        driver.fetch_end_batch_start()
        return batch


class EvalLoader:
    """An eval loader wrapped by :meth:`Run.eval`; one iteration is one evaluation."""

    def __init__(self, run: Run, facts: LoaderFacts) -> None:
        self._run = run
        self.facts = facts

    def __len__(self) -> int:
        length = len(self.facts.loader)
        cap = self.facts.num_batches
        return length if cap is None else min(length, cap)

    def __iter__(self) -> Iterator[Any]:
        run = self._run
        run._require("run.eval(...)")
        run._close_eval()
        run._driver.eval_start([self.facts])
        it = _EvalIterator(run, self.facts)
        run._eval = it
        return it


class _EvalIterator:
    def __init__(self, run: Run, facts: LoaderFacts) -> None:
        self._run = run
        self.facts = facts
        self._iterator = iter(facts.loader)
        self.started = 0
        self._ended = False
        self._exhausted = False
        self._ran_out = False  # the loader's own iterator raised StopIteration

    def __iter__(self) -> _EvalIterator:
        return self

    def __next__(self) -> Any:
        run = self._run
        if self._ended:
            if self._exhausted:
                raise StopIteration
            raise RuntimeError(
                f"Eval of {self.facts.name!r} was already ended when the loop moved on; "
                f"iterate `run.eval(loader)` again for a new evaluation. {ORDER}"
            )
        run._require("run.eval(...)")
        driver = run._driver
        cap = self.facts.num_batches
        if cap is not None and self.started >= cap:
            self.finish(early=False)
            raise StopIteration
        if self.started:
            driver.eval_batch_end()
        try:
            batch = next(self._iterator)
        except StopIteration:
            self._ran_out = True
            self.finish(early=False)
            raise
        driver.eval_batch_start()
        self.started += 1
        return batch

    def finish(self, early: bool) -> None:
        """EVAL_END; ``early``: the loop left it, so the batches that ran are its plan.

        The pass is exhausted only where the loader's iterator ran out; one that
        ``max_batches`` or the loop stopped is not (it may have had more).
        """
        self._ended = True
        self._exhausted = not early
        run = self._run
        run._eval = None
        if early:
            facts = self.facts
            run._driver.evals[0] = LoaderFacts(facts.name, facts.loader, False, self.started)
        run._driver.eval_end(LoaderPass(self.started, self._ran_out))


class _Save:
    """The context manager of :meth:`Run.checkpoint`."""

    def __init__(self, run: Run, directories: list[str]) -> None:
        self._run = run
        self.directories = directories
        self._entered = False

    def __enter__(self) -> _Save:
        run = self._run
        if self._entered or run._save is not None:
            raise RuntimeError(
                "`run.checkpoint(...)` entered while a save is in progress (saves do not "
                f"nest, and each `run.checkpoint(...)` is entered once). {ORDER}"
            )
        run._require("run.checkpoint(...)")
        self._entered = True
        run._close_eval()
        driver = run._driver
        try:
            driver.save_start(self.directories, model=run._model)
        except BaseException:
            driver.saving = False
            raise
        run._save = self
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        run = self._run
        run._save = None
        if exc is None and run._state == "active":
            run._driver.save_end()
        else:
            run._driver.saving = False


# -- Public classes: written by tools/generate_api.py from the guard registry; do not edit
# (tests/integrations/test_api.py checks it): run `python tools/generate_api.py` after
# changing a guard's settings or the registry.


class RankGuard(_LoopGuard):
    """Every rankguard guard with sound defaults, as a hand-written loop's guard (``guard.fit``).

    Args:
        exchange_timeout_s: How long a cross-rank check waits for every rank
            before naming the ones that did not arrive (seconds; grows by 5 ms
            per rank with the world size, see ``docs/scale.md``). The hang
            watchdog's own exchanges use its settings.
        **per_guard_config: Per guard, by snake-case name, a dict of its
            settings or ``False`` to leave it out, e.g.
            ``RankGuard(batch_parity_guard={"on_violation": "warn"}, drop_last_guard=False)``.
    """

    @bundle_init(_LoopGuard)
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


class HangWatchdog(_LoopGuard):
    """A hand-written loop's guard (``guard.fit``) for :class:`rankguard.callbacks.HangWatchdog` (same arguments)."""  # noqa: E501

    @guard_init(_LoopGuard, "hang_watchdog")
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


class DataConsistencyGuard(_LoopGuard):
    """A hand-written loop's guard (``guard.fit``) for :class:`rankguard.callbacks.DataConsistencyGuard` (same arguments)."""  # noqa: E501

    @guard_init(_LoopGuard, "data_consistency_guard")
    def __init__(
        self,
        *,
        on_violation: str = "raise",
        sample_items: int = 16,
        check_content: bool | str = "auto",
        check_rng: bool = True,
    ) -> None:
        """Builds the guards of :class:`DataConsistencyGuard`."""


class DropLastGuard(_LoopGuard):
    """A hand-written loop's guard (``guard.fit``) for :class:`rankguard.callbacks.DropLastGuard` (same arguments)."""  # noqa: E501

    @guard_init(_LoopGuard, "drop_last_guard")
    def __init__(
        self,
        *,
        mode: str = "check",
        on_violation: str = "raise",
        warn_eval_padding: bool = True,
    ) -> None:
        """Builds the guards of :class:`DropLastGuard`."""


class BatchParityGuard(_LoopGuard):
    """A hand-written loop's guard (``guard.fit``) for :class:`rankguard.callbacks.BatchParityGuard` (same arguments)."""  # noqa: E501

    @guard_init(_LoopGuard, "batch_parity_guard")
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


class SharedDirBarrier(_LoopGuard):
    """A hand-written loop's guard (``guard.fit``) for :class:`rankguard.callbacks.SharedDirBarrier` (same arguments)."""  # noqa: E501

    @guard_init(_LoopGuard, "shared_dir_barrier")
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


class CheckpointPlanner(_LoopGuard):
    """A hand-written loop's guard (``guard.fit``) for :class:`rankguard.callbacks.CheckpointPlanner` (same arguments)."""  # noqa: E501

    @guard_init(_LoopGuard, "checkpoint_planner")
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


class DataStallMonitor(_LoopGuard):
    """A hand-written loop's guard (``guard.fit``) for :class:`rankguard.callbacks.DataStallMonitor` (same arguments)."""  # noqa: E501

    @guard_init(_LoopGuard, "data_stall_monitor")
    def __init__(
        self,
        *,
        on_violation: str = "warn",
        threshold: float = 0.5,
        window: int = 10,
        interval: int | None = None,
    ) -> None:
        """Builds the guards of :class:`DataStallMonitor`."""


class StragglerMonitor(_LoopGuard):
    """A hand-written loop's guard (``guard.fit``) for :class:`rankguard.callbacks.StragglerMonitor` (same arguments)."""  # noqa: E501

    @guard_init(_LoopGuard, "straggler_monitor")
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
    "EvalLoader",
    "Run",
    "TrainLoader",
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
