"""A straggler: rank 1's forward 1.5 times as long."""

from __future__ import annotations

import time

import torch.distributed as dist
from transformers import Trainer

from rankguard.integrations.transformers import RankGuard
from tests.e2e.common import gloo_training_args, seed_everything, tiny_bert, token_dataset
from tests.e2e.hf_trainer_concerns import harness
from tests.e2e.hf_trainer_concerns.harness import COUNTERS, QUICK


def straggler() -> None:
    """Rank 1's forward takes 1.5x as long (tests/e2e/straggler_common.py), 20 steps."""
    import torch

    from tests.e2e.straggler_common import BATCHES, STRAGGLER, forward_delay

    COUNTERS.clear()
    seed_everything(0)
    torch.set_num_threads(1)  # two ranks on two shared cores
    model = tiny_bert()
    # Its tiny BERT's own forward takes 5-10 ms on these cores, not always alike on both:
    # 80 ms against 120 ms keeps the score what the 1.5x says (0.67; 0.69 at 6.5 and 5 ms).
    delay = forward_delay(dist.get_rank(), slow=True, base_s=0.08)
    # Inside the model's forward: its embeddings take the time a bigger model would.
    model.bert.embeddings.register_forward_pre_hook(lambda module, args: time.sleep(delay))
    args = gloo_training_args(
        harness.OUT / "straggler",
        per_device_train_batch_size=4,
        max_steps=BATCHES,
        eval_strategy="no",
        save_strategy="no",
        logging_steps=4,
        seed=0,
    )
    guard = RankGuard(straggler_monitor=STRAGGLER, **QUICK)
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(4 * 2 * BATCHES))
    trainer.add_callback(guard)
    try:
        trainer.train()
    finally:
        guard.close()
    logged = [key for entry in trainer.state.log_history for key in entry]
    COUNTERS["rankguard_keys_logged"] = sorted({k for k in logged if k.startswith("rankguard/")})


SCENARIOS = {
    "straggler": straggler,
}
