"""The Hugging Face ``Trainer`` (a tiny BERT, 2 CPU ranks) whose accumulation windows differ.

Usage::

    HF_HUB_OFFLINE=1 torchrun --standalone --nproc-per-node 2 \
        tests/e2e/split_cause_hf_job.py OUT_DIR

``gradient_accumulation_steps`` is worked out on each rank from its own device (here: 2 on
rank 0, 3 on rank 1), the global batch it aims at being the same: every rank runs 10
microbatches a pass, rank 0 in windows of 2 and rank 1 in windows of 3 and a last one of 1.
The ranks' buffer broadcasts and gradient all-reduces pair up until rank 1's pass is over;
rank 0's fifth window then waits for a peer that left. Rank 0 writes the moment its first
window ends (rank 1's goes on) to ``OUT_DIR/split.json``; reports go to ``OUT_DIR/reports``.
``E2E_RANKGUARD=off``: no rankguard.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback

from tests.e2e.common import gloo_training_args, rankguard_off, tiny_bert, token_dataset

#: Each rank's ``gradient_accumulation_steps``, as its own device memory decided it.
WINDOWS = (2, 3)


class MarkSplit(TrainerCallback):
    """Writes the moment rank 0 ends its first window (rank 1's goes on)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if dist.get_rank() == 0 and state.global_step == 0:
            (self.out / "split.json").write_text(json.dumps({"t": time.time(), "rank": 0}))


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    logging.basicConfig(format=f"%(created).3f [rank {rank}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("rankguard").setLevel(logging.INFO)
    torch.set_num_threads(1)
    args = gloo_training_args(
        out / "hf",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=WINDOWS[rank],
        num_train_epochs=1,
        eval_strategy="no",
        save_strategy="no",
        logging_steps=500,
        seed=0,
    )
    callbacks: list[TrainerCallback] = [MarkSplit(out)]
    if not rankguard_off():
        from rankguard.integrations.transformers import RankGuard

        callbacks.append(RankGuard(hang_watchdog={"report_dir": str(out / "reports")}))
    trainer = Trainer(
        model=tiny_bert(), args=args, train_dataset=token_dataset(40), callbacks=callbacks
    )
    trainer.train()
    (out / f"rank{rank}.json").write_text(json.dumps({"returned": time.time()}))


if __name__ == "__main__":
    main()
