"""A real 2-rank Lightning job (CPU, gloo) that runs rankguard scenarios of every concern.

Run: ``python lightning_job.py OUT SCENARIO...`` (Lightning's DDP launcher
re-executes it for rank 1 with the same arguments); the checkpoint scenarios
one torchrun per simulated node (``benchmarks/launch.py::launch_nodes``).

Each scenario is a fresh ``Trainer`` in the same processes. The scenarios live in
``tests/e2e/lightning_concerns/``, a module per concern (named as its tests'
``tests/frameworks/test_<concern>_e2e.py``), beside ``harness.py``. After each, every
rank writes ``OUT/rank<r>.json``: a report whose ``scenarios`` hold each
record, or for the hang and checkpoint scenarios the records alone. A hang
scenario never returns, so it comes last; an error in the last scenario is
re-raised, so the process exits non-zero as a real job would.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from tests.e2e.lightning_concerns import (
    batches,
    checkpoint,
    data,
    hang,
    harness,
    resume,
    straggler,
)
from tests.e2e.lightning_concerns.harness import Outcome, rank

#: The concerns, each a module of ``SCENARIOS``, the ``setup(names)`` a launch runs before the
#: first of them (it returns how one scenario runs into its record, and the error to re-raise
#: if last), and ``RECORDS_ALONE``.
CONCERNS = [batches, data, checkpoint, resume, hang, straggler]


def write(report: dict[str, Any]) -> None:
    path = os.path.join(harness.OUT, f"rank{rank()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)


def main(argv: list[str]) -> int:
    harness.OUT, *names = argv
    concerns = {name: c for c in CONCERNS for name in c.SCENARIOS}
    unknown = [n for n in names if n not in concerns]
    if unknown or not names:
        raise SystemExit(f"unknown scenarios {unknown}; valid: {sorted(concerns)}")
    os.makedirs(harness.OUT, exist_ok=True)
    report: dict[str, Any] = {"pid": os.getpid(), "finished": False, "scenarios": {}}
    ready: dict[Any, Callable[[str], Outcome]] = {}
    error: BaseException | None = None
    for name in names:
        concern = concerns[name]
        if concern not in ready:
            ready[concern] = concern.setup(names)
        record, error = ready[concern](name)
        report["rank"] = rank()
        report["scenarios"][name] = record
        if name == names[-1]:
            report.update(finished=True, exit_code=0 if error is None else 1, ended_at=time.time())
        write(report["scenarios"] if concern.RECORDS_ALONE else report)
    if error is not None:
        raise error
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
