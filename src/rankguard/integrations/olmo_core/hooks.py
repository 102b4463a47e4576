"""The OLMo-core methods the adapter wraps, per instance, and what their wrappers call.

Evals and saves have no callback hook of their own in OLMo-core: they are marked
where its public methods are called (:func:`trainer_wrappers`), and a resume where
the Trainer's checkpointer reads it (:func:`hook_load`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from olmo_core.eval import Evaluator
from olmo_core.train import Trainer

# The core guard: the package's own ``SharedDirBarrier`` is the OLMo-core callback of that name.
from rankguard.callbacks.checkpoint.shared_dir_barrier import (
    SharedDirBarrier as CoreSharedDirBarrier,
)
from rankguard.callbacks.core.events import LoaderFacts
from rankguard.integrations._common import Unhook, wrap_method
from rankguard.integrations._driver import EventDriver
from rankguard.integrations.olmo_core.decisions import rank0_timeout

__all__ = ["Wrapper", "hook_load", "hook_trainer", "trainer_wrappers"]


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
