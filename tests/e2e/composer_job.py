"""A real 2-rank Composer job (CPU, gloo) that runs rankguard scenarios of every concern.

Run: ``composer -n 2 composer_job.py OUT SCENARIO...``; the checkpoint scenarios
one torchrun per simulated node (``benchmarks/launch.py::launch_nodes``);
``restart`` alone under ``torchrun --max-restarts=1``.

Each scenario is a fresh Trainer in the same processes (``composer_concerns/harness.py``);
outcomes per rank go to ``OUT/rank{N}.json`` (see tests/e2e/common.py). The scenarios live
in ``tests/e2e/composer_concerns/``, a module per concern (each named after its tests'
``tests/frameworks/test_<concern>_e2e.py``). A hang scenario, ``dead_worker``,
``data_check_raises`` and ``restart`` end the job, so each comes last.
"""

from __future__ import annotations

import sys
from types import ModuleType

from tests.e2e.common import Recorder
from tests.e2e.composer_concerns import (
    batches,
    checkpoint,
    data,
    hang,
    harness,
    restart,
    resume,
    straggler,
)

# --- The command line ----------------------------------------------------------------------------

#: The concerns, each a module of ``SCENARIOS`` (name: a function that runs one), the
#: ``setup(names)`` a launch runs once before the first of them, and ``ENDS_JOB``.
CONCERNS = [batches, data, checkpoint, hang, restart, straggler, resume]


def main() -> None:
    harness.OUT, *names = sys.argv[1:]
    set_up: set[ModuleType] = set()
    recorder = Recorder(harness.OUT)
    for name in names:
        concern = next(c for c in CONCERNS if name in c.SCENARIOS)
        if concern not in set_up:
            set_up.add(concern)
            concern.setup(names)
        harness.SCENARIO = name
        if name in concern.ENDS_JOB:
            concern.SCENARIOS[name]()
        else:
            recorder.run(name, concern.SCENARIOS[name], harness.COUNTERS)


if __name__ == "__main__":
    main()
