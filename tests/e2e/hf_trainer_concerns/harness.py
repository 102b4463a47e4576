"""What every HF Trainer scenario shares: the launch's state, a fresh Trainer, its counters.

``OUT`` is set by ``tests/e2e/hf_trainer_job.py`` (read it as ``harness.OUT``); ``COUNTERS``
is what a scenario records beside its outcome.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import Trainer, TrainerCallback

from rankguard.integrations.transformers import RankGuard
from tests.e2e.common import gloo_training_args, tiny_bert


def _cpu_map_location(load):
    """transformers 4 loads a multi-rank resume's optimizer with ``map_location=args.device``,
    which a CPU-only gloo run (staging only; on GPUs it is ``cuda:N``) has as ``cpu:0``, a
    location torch 2.7 cannot restore: here it is ``cpu``."""

    def load_on_cpu(*args, map_location=None, **kwargs):
        if isinstance(map_location, torch.device) and map_location.type == "cpu":
            map_location = "cpu"
        return load(*args, map_location=map_location, **kwargs)

    return load_on_cpu


if transformers.__version__ < "5":
    torch.load = _cpu_map_location(torch.load)

COUNTERS: dict[str, Any] = {}
OUT = Path(".")
QUICK = {"hang_watchdog": {"exchange_period_s": 0.5}}


class Count(TrainerCallback):
    """Counts the optimizer steps and eval batches that actually ran on this rank."""

    def on_step_begin(self, args, state, control, **kwargs):
        COUNTERS["steps"] = COUNTERS.get("steps", 0) + 1

    def on_prediction_step(self, args, state, control, **kwargs):
        COUNTERS["eval_batches"] = COUNTERS.get("eval_batches", 0) + 1

    def on_save(self, args, state, control, **kwargs):
        COUNTERS["saves"] = COUNTERS.get("saves", 0) + 1


def train(
    name: str,
    guard: RankGuard | None,
    train_set,
    eval_set,
    *extra: TrainerCallback,
    output_dir: Path | None = None,
    resume: bool | None = None,
    trainer_class: type[Trainer] = Trainer,
    max_steps: int = 6,
    model: Any = None,
    **settings: Any,
) -> None:
    """Evaluates every 3 steps and saves every 4, for 6 steps (one epoch of 48 samples).

    ``trainer_class``: the user's subclass; ``max_steps``: more steps (a second epoch);
    ``model``: the user's own (default: :func:`tiny_bert`); ``settings``: more
    ``TrainingArguments``.
    """
    COUNTERS.clear()
    args = gloo_training_args(
        output_dir or OUT / name,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=max_steps,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=4,
        logging_steps=2,
        seed=0,
        **settings,
    )
    trainer = trainer_class(
        model=tiny_bert() if model is None else model,
        args=args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        callbacks=[c for c in (guard, Count(), *extra) if c is not None],
    )
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
        if guard is not None:
            guard.close()  # the Trainer calls no hook when train() raises
    logged = [key for entry in trainer.state.log_history for key in entry]
    COUNTERS["rankguard_keys_logged"] = sorted({k for k in logged if k.startswith("rankguard/")})
