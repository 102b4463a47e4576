"""A preemption under one launcher that stops the other ranks once one exits: a sharded save.

Every framework's stop as the field meets it across nodes (SIGTERM to node 1's launcher
only) is ``test_stop_nodes_e2e.py``; there no launcher ever ends another node's rank. What
that cannot show: one launcher for every rank, which sends SIGTERM to the others as soon
as one rank exits (Composer's ``composer -n 2``; torchrun does the same), while each rank
writes its own part of the checkpoint. Composer under FSDP2 with sharded checkpoints
(``tests/e2e/composer_stop_job.py OUT self sharded``); rank 1 sends itself SIGTERM after
train batch 6, as a scheduler that signals one process. With ``RankGuard()`` at its
defaults:

- every rank's fit ends after the same batch (``OUT/rank{N}.json``), within the stop's
  grace of the signal;
- ``ep0-ba{D}/`` holds every rank's part: the exit path's meeting (rank 0 last) lets no
  rank's exit cut another's save short;
- every rank ends through the exit path with 75, and the launcher names 75 for the ranks
  it saw end;
- each rank logs exactly one rankguard WARNING, the ``Preempted`` one, and no rankguard
  ERROR.
"""

from __future__ import annotations

import json
import re
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from rankguard.callbacks.hang.stop import STOP_EXIT_CODE
from tests.frameworks.stop_lines import assert_every_rank_preempted
from tests.mp import ROOT, run_job

SIGNAL_AT = 6
#: The harness's kill: far above what a run takes (10-60 s on 2 shared cores; 110 s at a
#: load of 50).
LAUNCH_TIMEOUT_S = 300
#: The stop's grace (``stop_grace_s``'s default): every rank's fit ended within it of the signal.
GRACE_S = 20.0


@pytest.mark.framework
def test_sigterm_on_one_rank_under_composers_launcher_every_rank_saves_its_shard_exit_75(
    tmp_path,
):
    if find_spec("composer") is None:
        pytest.skip("needs composer")
    job = ROOT / "tests" / "e2e" / "composer_stop_job.py"
    cmd = [str(Path(sys.executable).parent / "composer"), "-n", "2"]
    args = [str(job), str(tmp_path), "self", "sharded"]
    done = run_job([*cmd, *args], timeout_s=LAUNCH_TIMEOUT_S, cwd=tmp_path)
    output = done.output
    signalled = json.loads((tmp_path / "signalled.json").read_text())
    assert signalled["step"] == SIGNAL_AT
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    (step,) = {r["step"] for r in results}  # the same batch on both ranks, past the signal's
    assert SIGNAL_AT < step < SIGNAL_AT + 40, results
    took = max(r["ended_at"] for r in results) - signalled["at"]
    assert 0 < took < GRACE_S, took
    saved = tmp_path / "ckpt" / f"ep0-ba{step}"  # FSDP2's sharded checkpoint: a part per rank
    parts = [saved / ".metadata", *(saved / f"__{r}_0.distcp" for r in (0, 1))]
    missing = [p for p in parts if not p.exists()]
    assert not missing, (missing, output[-6000:])
    # the launcher, which stops the others once one rank exits, names 75 for those it saw end
    named = re.findall(r"Global rank (\d) \(PID \d+\) exited with code (-?\d+)", output)
    assert named and {int(code) for _, code in named} == {STOP_EXIT_CODE}, output[-6000:]
    assert_every_rank_preempted(output, step)  # the exit path's 75, one WARNING, no ERROR
    print(f"composer_sharded: every rank stopped after batch {step}, {took:.1f} s after the signal")
