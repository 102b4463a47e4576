"""The OLMo-core ``Trainer`` (a 1-layer Llama-like transformer from a config) with rankguard.

Usage::

    torchrun --standalone --nproc-per-node 2 tests/e2e/olmo_core_job.py OUT_DIR SCENARIO...

Each scenario is a fresh model and ``Trainer`` in the same two processes
(``olmo_core_concerns/harness.py``); outcomes per rank go to ``OUT_DIR/rank{N}.json`` (see
``tests/e2e/common.py``). The scenarios live in ``tests/e2e/olmo_core_concerns/``, a module
per concern (``resume``, ``data``, ``checkpoint``, ``hang``), each with its ``SCENARIOS``.
``resume`` continues ``healthy``'s run from its last checkpoint, so it comes
after it; ``post_eval_stall`` never returns (the watchdog ends every rank with
exit code 75), so it must come last; rank 1 writes the moment its stall starts
to ``OUT_DIR/stall.json``. ``data_check_raises`` (rank 1's data check raises at step
6, then its teardown waits) ends the job (exit code 70), so it runs alone; rank 1
writes the moment it raises to ``OUT_DIR/raised.json``, each rank its pid to
``OUT_DIR/pid{N}``. ``metric_on_one_rank_bare`` (no rankguard) ends in
gloo's abort of both processes, so it runs alone. Token files are random ids
written into ``OUT_DIR``; nothing needs the network.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.e2e.common import run_scenarios
from tests.e2e.olmo_core_concerns import checkpoint, data, hang, harness, resume

#: Every concern's scenarios, by name.
SCENARIOS = {
    name: run
    for concern in (resume, data, checkpoint, hang)
    for name, run in concern.SCENARIOS.items()
}


def main() -> None:
    harness.OUT = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # two ranks on two shared cores
    run_scenarios(SCENARIOS, harness.COUNTERS)


if __name__ == "__main__":
    main()
