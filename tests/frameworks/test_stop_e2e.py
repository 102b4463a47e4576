"""A preemption on one rank, where the framework's own save differs: who writes the stop's save.

Every framework's stop as the field meets it (SIGTERM to node 1's launcher only) is
``test_stop_nodes_e2e.py``; these are the cases it does not cover, where the save at the
agreed step comes another way. How SIGTERM reaches rank 1 does not change that way (the
handler on rank 1 is the same), so rank 1 sends itself SIGTERM after train step 6:

- ``lightning_epoch``: Lightning's ``ModelCheckpoint`` at its defaults saves at the epoch's
  end the stop brings (``epoch=0-step=D.ckpt``, once; rankguard adds none);
- ``hf_jit``: transformers 5's just-in-time checkpoint on SIGTERM, with
  ``save_strategy="no"``: rankguard's handler stands in for the JIT one during the fit and
  the Trainer writes ``checkpoint-D`` at the agreed step;
- ``composer_sharded``: Composer under FSDP2 with sharded checkpoints, under one launcher
  (``composer -n 2``), which sends SIGTERM to the other ranks once one exits: ``ep0-ba{D}/``
  holds every rank's part (the exit path's meeting, rank 0 last, cuts none short).

For each, with ``RankGuard()`` at its defaults: every rank's fit ends after the same step
(``OUT/rank{N}.json``), within the stop's grace of the signal; the save of that step is
there; every process exits with 75 (restart); each rank logs exactly one rankguard
WARNING, the ``Preempted`` one, and no rankguard ERROR. Lightning and the HF Trainer run in
today's world (both ranks started as a launcher starts them), Composer in its own.
"""

from __future__ import annotations

import json
import re
import sys
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path

import pytest

from benchmarks.launch import finish, free_port, job_env, start
from rankguard.callbacks.hang.stop import STOP_EXIT_CODE
from tests.mp import ROOT, run_job

E2E = ROOT / "tests" / "e2e"
SIGNAL_AT = 6
#: The harness's kill: far above what a run takes (about 10-25 s on 2 shared cores).
LAUNCH_TIMEOUT_S = 150
#: The stop's grace (``stop_grace_s``'s default): every rank's fit ended within it of the signal.
GRACE_S = 20.0
#: Each case: the module it needs.
NEEDS = {"lightning_epoch": "lightning", "hf_jit": "transformers", "composer_sharded": "composer"}


def _direct(framework: str, out: Path) -> str:
    """Both ranks of ``stop_frameworks_job.py``, as a launcher starts them; each exits 75."""
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = job_env(
            PYTHONPATH=f"{ROOT}:{ROOT / 'src'}",
            PYTHONUNBUFFERED="1",
            HF_HUB_OFFLINE="1",
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        cmd = [sys.executable, str(E2E / "stop_frameworks_job.py"), framework, str(out), "self"]
        procs.append(start(cmd, env=env, cwd=out))
    ended = finish(procs, LAUNCH_TIMEOUT_S)
    output = "\n".join(e.stdout for e in ended)
    if any(e.timed_out for e in ended):
        pytest.fail(f"not ended within {LAUNCH_TIMEOUT_S} s:\n{output[-6000:]}")
    assert [e.returncode for e in ended] == [STOP_EXIT_CODE] * 2, output[-6000:]
    return output


def _composer(out: Path) -> str:
    """``composer -n 2 composer_stop_job.py OUT self sharded``; the launcher names 75."""
    cmd = [str(Path(sys.executable).parent / "composer"), "-n", "2"]
    cmd += [str(E2E / "composer_stop_job.py"), str(out), "self", "sharded"]
    done = run_job(cmd, timeout_s=LAUNCH_TIMEOUT_S, cwd=out)
    # the launcher, which stops the others once one rank exits, names 75 for those it saw end
    named = re.findall(r"Global rank (\d) \(PID \d+\) exited with code (-?\d+)", done.output)
    assert named and {int(code) for _, code in named} == {STOP_EXIT_CODE}, done.output[-6000:]
    return done.output


def _saved(case: str, folder: Path, step: int) -> list[Path]:
    """The files the framework's save of ``step`` writes, every rank's part."""
    if case == "lightning_epoch":
        return [folder / f"epoch=0-step={step}.ckpt"]
    if case == "hf_jit":
        return [folder / f"checkpoint-{step}" / "trainer_state.json"]
    saved = folder / f"ep0-ba{step}"  # FSDP2's sharded checkpoint: each rank writes its part
    return [saved / ".metadata", *(saved / f"__{r}_0.distcp" for r in (0, 1))]


def _rankguard_lines(output: str, rank: int, level: str) -> list[str]:
    return re.findall(rf"\[rank {rank}\] {level} rankguard\.\S+: (.*)", output)


@pytest.mark.framework
@pytest.mark.parametrize("case", ["lightning_epoch", "hf_jit", "composer_sharded"])
def test_sigterm_on_one_rank_stops_every_rank_after_one_step_saved_by_its_saver_exit_75(
    case, tmp_path
):
    if find_spec(NEEDS[case]) is None:
        pytest.skip(f"needs {NEEDS[case]}")
    if case == "hf_jit" and version("transformers") < "5":
        pytest.skip("transformers 5's JIT checkpoint")
    output = _composer(tmp_path) if case == "composer_sharded" else _direct(case, tmp_path)
    signalled = json.loads((tmp_path / "signalled.json").read_text())
    assert signalled["step"] == SIGNAL_AT
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    (step,) = {r["step"] for r in results}  # the same step on both ranks, past the signal's
    assert SIGNAL_AT <= step < SIGNAL_AT + 40, results
    took = max(r["ended_at"] for r in results) - signalled["at"]
    assert 0 < took < GRACE_S, took
    missing = [p for p in _saved(case, tmp_path / "ckpt", step) if not p.exists()]
    assert not missing, (missing, output[-6000:])
    if case == "lightning_epoch":  # Lightning's own save, once: rankguard adds none
        assert results[0]["files"] == [f"epoch=0-step={step}.ckpt"], results[0]["files"]
    if case == "hf_jit":
        state = json.loads(_saved(case, tmp_path / "ckpt", step)[0].read_text())
        assert state["global_step"] == step
        # rankguard's handler stood in for the JIT checkpoint's during the fit
        assert re.search(r"SIGTERM already had a handler \(\S*CheckpointManager\._sigterm", output)
    for rank in (0, 1):  # every rank ends through the exit path with 75
        ended = _rankguard_lines(output, rank, "INFO")
        assert any(f"ending (preempted) with exit code {STOP_EXIT_CODE}" in e for e in ended), (
            rank,
            output[-6000:],
        )
        (warning,) = _rankguard_lines(output, rank, "WARNING")
        assert warning.startswith(
            f"rankguard hang_watchdog: Preempted: SIGTERM on rank 1 at step {step}; "
            f"every rank stops after train step {step}"
        ), warning
        assert _rankguard_lines(output, rank, "ERROR") == [], output[-6000:]
    print(f"{case}: every rank stopped after step {step}, {took:.1f} s after the signal")
