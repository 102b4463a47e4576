"""A preemption reaching rank 1 only, in a real 2-rank OLMo-core job (CPU, gloo).

Run: ``torchrun --standalone --nproc-per-node 2 olmo_core_stop_job.py OUT self|launcher``, or
one torchrun per node (``--nnodes 2``). The Trainer is
:func:`tests.e2e.olmo_core_concerns.harness.build_trainer`'s (no evals, a save interval far past the
stop). After train step ``SIGNAL_AT`` rank 1 writes the moment to ``OUT/signalled.json``
and, with ``self``, sends itself SIGTERM; with ``launcher`` the test sends SIGTERM to its
node's torchrun, which passes it on. ``RankGuard`` at its defaults agrees the stop and
every rank cancels the run after the same step, where the checkpointer's ``post_train``
saves. Each rank then writes ``OUT/rank{N}.json`` (its step, the time); the process exits
with 75. Log lines carry their Unix time.

``RANKGUARD=off`` runs the same job without the ``RankGuard`` callback
(``benchmarks/preemption.py``): the same signal after the same step, the same checkpointer.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from olmo_core.train.callbacks import Callback

from rankguard.integrations.olmo_core import RankGuard
from tests.e2e.olmo_core_concerns.harness import PER_RANK, build_trainer

SIGNAL_AT = 6
STEP_S = 0.05
STEPS = 400  # ~20 s of steps: the stop comes long before


class Preempt(Callback):
    """Paces the steps; after step ``SIGNAL_AT`` rank 1 is signalled (or signals itself)."""

    def __init__(self, out: Path, sender: str) -> None:
        self.out = out
        self.sender = sender

    def post_step(self) -> None:
        time.sleep(STEP_S)
        if dist.get_rank() == 1 and self.trainer.global_step == SIGNAL_AT:
            (self.out / "signalled.json").write_text(
                json.dumps({"at": time.time(), "step": SIGNAL_AT})
            )
            if self.sender == "self":
                os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    out, sender = Path(sys.argv[1]).resolve(), sys.argv[2]
    rank = int(os.environ["RANK"])
    logging.basicConfig(format=f"%(created).3f [rank {rank}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("rankguard").setLevel(logging.INFO)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    callbacks: dict[str, Callback] = {"preempt": Preempt(out, sender)}
    if os.environ.get("RANKGUARD") != "off":
        guard = RankGuard(hang_watchdog={"report_dir": str(out / "reports")})
        callbacks = {"rankguard": guard, **callbacks}
    trainer = build_trainer(
        out / "work",
        callbacks,
        eval_sequences=None,
        save_folder=out / "ckpt",
        steps=STEPS,
        save_interval=STEPS * 10,
        sequences=STEPS * PER_RANK * 2,
    )
    trainer.fit()
    record = {"step": trainer.global_step, "ended_at": time.time()}
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
