"""The Hugging Face ``Trainer`` (a 2-layer BERT built from a config) with rankguard, on 2 ranks.

Usage::

    HF_HUB_OFFLINE=1 torchrun --standalone --nproc-per-node 2 tests/e2e/hf_trainer_job.py \
        OUT_DIR SCENARIO...

Each scenario is a fresh model and ``Trainer`` in the same two processes
(``hf_trainer_concerns/harness.py``); outcomes per rank go to ``OUT_DIR/rank{N}.json`` (see
``tests/e2e/common.py``). The scenarios live in ``tests/e2e/hf_trainer_concerns/``, a module
per concern (``data``, ``resume``, ``replica``, ``straggler``, ``hang``), each with its
``SCENARIOS``.
``post_eval_stall`` never returns (the watchdog ends every rank with exit code
75), nor does ``early_stop_one_rank`` (a proven deadlock: exit code 70), so either
must come last; rank 1 writes the moment its stall starts to ``OUT_DIR/stall.json``,
rank 0 the moment it decides to stop to ``OUT_DIR/split.json``. ``data_check_raises``
(rank 1's data check raises at step 6, then its teardown waits) ends the job (exit
code 70), so it runs alone; rank 1 writes the moment it raises to ``OUT_DIR/raised.json``,
each rank its pid to ``OUT_DIR/pid{N}``. Nothing needs the network: the model is built
from a config.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.e2e.common import run_scenarios
from tests.e2e.hf_trainer_concerns import data, hang, harness, replica, resume, straggler

#: Every concern's scenarios, by name.
SCENARIOS = {
    name: run
    for concern in (data, resume, replica, straggler, hang)
    for name, run in concern.SCENARIOS.items()
}


def main() -> None:
    harness.OUT = Path(sys.argv[1])
    run_scenarios(SCENARIOS, harness.COUNTERS)


if __name__ == "__main__":
    main()
