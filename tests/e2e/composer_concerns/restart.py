"""A Composer hang ended and restarted by torchrun (tests/frameworks/test_restart_e2e.py)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable

from composer import Callback

from rankguard.integrations.composer import RankGuard
from tests.e2e.composer_concerns import harness
from tests.e2e.composer_concerns.hang import stall_after_eval
from tests.e2e.composer_concerns.harness import fit, rank, sharded


def attempt() -> int:
    return int(os.environ["TORCHELASTIC_RESTART_COUNT"])


class Record(Callback):
    """Writes what this rank starts from and ends at (``OUT/attempt{N}_rank{R}.json``).

    On the first attempt rank 1 never returns from its second eval (batch 8).
    """

    def __init__(self, guard: RankGuard) -> None:
        self.guard = guard
        self.record: dict = {"pid": os.getpid()}

    def _write(self) -> None:
        path = os.path.join(harness.OUT, f"attempt{attempt()}_rank{rank()}.json")
        with open(path, "w") as file:
            json.dump(self.record, file, indent=1)

    def fit_start(self, state, logger):
        watchdog = next(g for g in self.guard.runner.guards if g.name == "hang_watchdog")
        self.record.update(
            start_batch=int(state.timestamp.batch),
            restored=watchdog.heartbeats.restored,
            deadlines=watchdog.deadlines,
        )
        self._write()

    def eval_end(self, state, logger):
        if attempt() == 0 and rank() == 1 and int(state.timestamp.batch) == 8:
            stall_after_eval("stall.json")  # the bug, on the first attempt only

    def fit_end(self, state, logger):
        self.record["end_batch"] = int(state.timestamp.batch)
        self._write()


def restart() -> None:
    """Each attempt: 12 train batches, an eval every 4 and a checkpoint every 2, ``autoresume``.

    The watchdog aborts at its calibrated deadline (4 s floor); the second
    attempt resumes from the last checkpoint and finishes.
    """
    os.environ.setdefault("NODE_RANK", os.environ["GROUP_RANK"])  # Composer's name, torchrun's
    logging.basicConfig(format="%(name)s %(levelname)s: %(message)s")
    logging.getLogger("rankguard.callbacks.hang_watchdog").setLevel(logging.INFO)
    watchdog = {
        "abort_at": "calibrated",
        "floor_s": 4.0,
        "warmup_steps": 0,
        "exchange_period_s": 0.5,
        "report_dir": os.path.join(harness.OUT, "reports"),
    }
    guard = RankGuard(hang_watchdog=watchdog)  # first: it sees EVAL_END before the stall
    fit(
        sharded(64),
        [guard, Record(guard)],
        sharded(32),
        eval_interval="4ba",
        max_duration="12ba",
        save_folder=os.path.join(harness.OUT, "checkpoints"),
        save_interval="2ba",
        run_name="restart",
        autoresume=True,
    )


SCENARIOS: dict[str, Callable[[], None]] = {"restart": restart}


def setup(names: list[str]) -> None:
    """Nothing to set up before this concern's first scenario."""


#: Scenarios that end the job: run bare (not recorded), so the process exits as it would.
ENDS_JOB: set[str] = {"restart"}
