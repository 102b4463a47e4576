"""The Hugging Face Trainer's private names rankguard reads (see the package's docstring).

The Trainer passes its callbacks neither itself nor where its training loop is:
both are read from the call stack, from the frame of the Trainer method that
called the hook. ``tests/integrations/test_private_transformers.py`` runs a real
Trainer and fails if these reads stop finding what they look for.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Mapping
from typing import Any, NamedTuple

from transformers import Trainer

__all__ = ["TRAINER_DEPTH", "LoopPosition", "calling_trainer", "loop_position", "trainer_frame"]

#: How deep :func:`trainer_frame` looks: hook <- CallbackHandler.call_event <-
#: CallbackHandler.on_<event> <- the Trainer's method.
TRAINER_DEPTH = 6


def trainer_frame(frame: types.FrameType | None) -> types.FrameType | None:
    """The frame of a ``Trainer`` method at most :data:`TRAINER_DEPTH` frames up from ``frame``.

    Reads each frame's ``f_locals["self"]``: the Trainer calls every callback hook
    from one of its own methods through its ``CallbackHandler``, and no public API
    hands a callback the Trainer or its loop's state.
    """
    for _ in range(TRAINER_DEPTH):
        if frame is None or isinstance(frame.f_locals.get("self"), Trainer):
            return frame
        frame = frame.f_back
    return None


def calling_trainer() -> Trainer | None:
    """The ``Trainer`` whose method is calling the current callback hook, or ``None``.

    ``TrainerCallback`` hooks receive the model, optimizer and loaders, but not
    the Trainer, whose public ``get_eval_dataloader`` builds the eval loaders
    before the first eval batch; the Trainer is ``self`` a few frames up
    (:func:`trainer_frame`, from ``sys._getframe``).

    Call it from the hook itself (it looks from its caller's caller up).
    """
    frame = trainer_frame(sys._getframe(2))
    return frame.f_locals["self"] if frame is not None else None


class LoopPosition(NamedTuple):
    """Where the Trainer's training loop is, from its local variables."""

    #: The loop's ``epoch`` (-1 where it is not found).
    epoch: int
    #: ``steps_trained_in_current_epoch``: the batches a resume skips (``None`` if not found).
    skipped: int | None
    #: The loader the epoch iterates (after ``skip_first_batches``), or ``None``.
    loader: Any


def loop_position() -> LoopPosition:
    """The Trainer's loop counters and the epoch's loader, from the loop's ``f_locals``.

    Call it from a hook (or a method the hook calls): it reads the frame of the
    Trainer method that runs the training loop (transformers 4.57:
    ``_inner_training_loop``'s ``epoch``, ``epoch_dataloader``; 5:
    ``_run_epoch``'s ``epoch``, ``train_dataloader``; both
    ``steps_trained_in_current_epoch``). The Trainer keeps these in local
    variables only: ``TrainerState`` has the global step, not the epoch's index,
    the batches a resume skips, or the loader that ``skip_first_batches`` made.
    """
    frame = trainer_frame(sys._getframe(1))
    local: Mapping[str, Any] = frame.f_locals if frame is not None else {}
    skipped = local.get("steps_trained_in_current_epoch")
    return LoopPosition(
        epoch=local.get("epoch", -1),
        skipped=skipped if isinstance(skipped, int) else None,
        loader=local.get("epoch_dataloader", local.get("train_dataloader")),  # 4.57, 5
    )
