"""A hand-written DDP loop (llama-recipes style) with rankguard's loop API, on 2 ranks.

Usage::

    torchrun --standalone --nproc-per-node 2 tests/e2e/torch_loop_job.py OUT_DIR SCENARIO...

Each scenario is a fresh model (DDP; ``fsdp2``: FSDP2 with sharded saves through
``torch.distributed.checkpoint``; ``short_*_stream``: DDP with ``join`` over
per-rank streams), loaders and ``guard.fit`` in the same two processes
(``torch_loop_concerns/harness.py``); outcomes per rank go to ``OUT_DIR/rank{N}.json`` (see
``tests/e2e/common.py``). The scenarios live in ``tests/e2e/torch_loop_concerns/``, a module
per concern (``data``, ``batches``, ``checkpoint``, ``replica``, ``straggler``, ``hang``),
each with its ``SCENARIOS``.
``post_eval_stall`` never returns (the watchdog ends every rank with exit code
75), so it must come last; rank 1 writes the moment its stall starts to
``OUT_DIR/stall.json``. ``rank0_collective`` (a collective on rank 0 only
after the first eval) never returns either: the deadlock ends every rank with
exit code 70; rank 0 writes the moment of the split to ``OUT_DIR/split.json``.
``data_check_raises`` (rank 1's data check raises at step 6, then its teardown
waits) never returns: it ends the job (exit code 70), so it runs alone; rank 1
writes the moment it raises to ``OUT_DIR/raised.json``, each rank its pid to
``OUT_DIR/pid{N}``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from tests.e2e.common import run_scenarios
from tests.e2e.torch_loop_concerns import (
    batches,
    checkpoint,
    data,
    hang,
    harness,
    replica,
    straggler,
)

#: Every concern's scenarios, by name.
SCENARIOS = {
    name: run
    for concern in (data, batches, checkpoint, replica, straggler, hang)
    for name, run in concern.SCENARIOS.items()
}


def main() -> None:
    harness.OUT = Path(sys.argv[1])
    dist.init_process_group("gloo")
    run_scenarios(SCENARIOS, harness.COUNTERS)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
