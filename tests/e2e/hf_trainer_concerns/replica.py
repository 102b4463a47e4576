"""Replicas that drift apart: an EMA kept in the model that rank 0 alone updates."""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from rankguard.integrations.transformers import RankGuard
from tests.e2e.common import seed_everything, seeded_split, tiny_bert
from tests.e2e.hf_trainer_concerns.harness import QUICK, train


class EMAOnMainProcess(TrainerCallback):
    """The bug: an EMA of the classifier kept in the model, updated "on the main process only".

    ``model.ema`` holds ``requires_grad=False`` copies of the classifier's weights, which DDP
    copies to every rank when it wraps the model and never again; rank 0 alone updates them.
    """

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero:
            with torch.no_grad():
                for average, param in zip(
                    model.ema.parameters(), model.classifier.parameters(), strict=True
                ):
                    average.lerp_(param, 0.1)


def ema_rank0() -> None:
    """A 6-step fit whose EMA rank 0 alone updates; a replica check at every step."""
    import copy

    seed_everything(0)
    model = tiny_bert()
    model.ema = copy.deepcopy(model.classifier).requires_grad_(False)
    guard = RankGuard(replica_guard={"interval": 1}, **QUICK)
    train("replica_ema_rank0", guard, *seeded_split(), EMAOnMainProcess(), model=model)


SCENARIOS = {
    "replica_ema_rank0": ema_rank0,
}
