"""A preemption that reaches one node only, in every framework: SIGTERM to node 1's launcher.

The field report: SLURM, Kubernetes or torchelastic signals each node's launcher at its own
moment; the launcher passes the signal on to its own ranks, and no launcher sees another
node's ranks. Staged as that: two nodes on this machine, each its own launcher with one
rank (``torchrun --nnodes 2``; Composer's ``composer --world_size 2 --nproc 1 --node_rank
N``), and once rank 1 is past train step 6 its launcher alone gets SIGTERM (node 0 is never
signalled). torchrun's agent passes SIGTERM on to its rank and SIGKILLs it 30 s later;
Composer's launcher raises ``SystemExit`` from the handler ``import composer`` installs,
and its clean-up sends SIGTERM to its rank and SIGKILLs it 30 s later. With ``RankGuard``
at its defaults:

- every rank's fit ends after the same train step, past 6 (``OUT/rank{N}.json``, written
  after the fit), within the stop's grace (20 s) of the signal;
- the framework's own save of that step was written (Lightning's ``ModelCheckpoint`` file,
  saved by rankguard under its name; the HF Trainer's ``checkpoint-D``; OLMo-core's
  ``step{D}``, every rank's part; Composer's ``ep0-ba{D}-rank0.pt``);
- every rank ends with 75 through the exit path: each logs it; a launcher names the code
  of a rank it saw end (node 0's torchrun rank 0's; node 1's torchrun, itself signalled,
  none; Composer's launchers each their own rank's, and exit with it);
- each rank logs one rankguard WARNING, "Preempted: SIGTERM on rank 1 at step D", and no
  rankguard ERROR.

Jobs: ``tests/e2e/stop_frameworks_job.py`` (Lightning, the HF Trainer),
``olmo_core_stop_job.py``, ``composer_stop_job.py``. Today's world runs Lightning, the HF
Trainer (transformers 5) and OLMo-core 3; Composer's world Composer and the ``older``
smoke (transformers 4.57, OLMo-core 2.4, Lightning on torch 2.7). The variants where the
save at the agreed step comes another way are ``test_stop_e2e.py`` (rank 1 signals itself:
Lightning's epoch save, transformers 5's JIT checkpoint, Composer's FSDP2 sharded save
under one launcher). The hand-written loop's counterpart: ``tests/hang/test_stop_nodes.py``.
"""

from __future__ import annotations

import json
import re
import zipfile
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from benchmarks.launch import finish, kill_tree, signal_node, start_nodes
from rankguard.callbacks.hang.stop import STOP_EXIT_CODE
from tests.mp import ROOT

E2E = ROOT / "tests" / "e2e"
SIGNAL_AT = 6
#: The stop's grace (``stop_grace_s``'s default): every rank's fit ended within it of the signal.
GRACE_S = 20.0
#: The harness's kill: far above what a passing run takes (10-25 s on 2 shared cores).
LAUNCH_TIMEOUT_S = 150
OLDER = torch.__version__ < "2.8"  # Composer's world (torch 2.7)
#: Each framework: its job, the job's arguments (``{out}``: the output folder), the node
#: launcher, the module it needs.
JOBS = {
    "lightning": ("stop_frameworks_job.py", ["lightning", "{out}", "launcher"], "torchrun"),
    "hf": ("stop_frameworks_job.py", ["hf", "{out}", "launcher"], "torchrun"),
    "olmo_core": ("olmo_core_stop_job.py", ["{out}", "launcher"], "torchrun"),
    "composer": ("composer_stop_job.py", ["{out}", "launcher"], "composer"),
}
NEEDS = {"lightning": "lightning", "hf": "transformers", "olmo_core": "olmo_core"}
#: A launcher's word on a rank's exit code: torchrun's failure summary, Composer's line.
_TORCHRUN_CODE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s+exitcode\s*:\s*(-?\d+)")
_COMPOSER_CODE = re.compile(r"Global rank (\d+) \(PID \d+\) exited with code (-?\d+)")


def _checkpoint_parts(framework: str, folder: Path, step: int) -> list[Path]:
    """The files the framework's save of ``step`` writes, every rank's part."""
    if framework == "lightning":  # the ModelCheckpoint's name for the step
        return [folder / f"epoch=0-step={step}.ckpt"]
    if framework == "hf":
        return [folder / f"checkpoint-{step}" / "trainer_state.json"]
    if framework == "composer":  # a full (unsharded) checkpoint: rank 0 writes it
        return [folder / f"ep0-ba{step}-rank0.pt"]
    saved = folder / f"step{step}"
    return [
        saved / "model_and_optim" / ".metadata",
        *(saved / "train" / f"rank{r}.pt" for r in (0, 1)),
    ]


def _rankguard_lines(output: str, rank: int, level: str) -> list[str]:
    return re.findall(rf"\[rank {rank}\] {level} rankguard\.\S+: (.*)", output)


def _launch(framework: str, out: Path) -> tuple[float, list[str], list[int]]:
    """Two nodes; SIGTERM to node 1's launcher once rank 1 is past step 6.

    Returns the moment of the signal, each launcher's output and exit code.
    """
    script, args, launcher = JOBS[framework]
    env = {
        "PYTHONPATH": f"{ROOT}:{ROOT / 'src'}",
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "OLMO_SHARED_FS": "1",  # the nodes share this machine's disk (OLMo-core asks, 2 nodes)
    }
    procs = start_nodes(
        E2E / script,
        [arg.format(out=out) for arg in args],
        nodes=2,
        per_node=1,
        env=env,
        merge_output=True,
        launcher=launcher,
        cwd=out,
    )
    try:
        signalled = signal_node(procs, out / "signalled.json", node=1, timeout_s=90)
        ended = finish(procs, LAUNCH_TIMEOUT_S if signalled is not None else 5)
    finally:
        for proc in procs:
            kill_tree(proc)
    outputs = [e.stdout for e in ended]
    if signalled is None or any(e.timed_out for e in ended):
        pytest.fail(f"signalled at {signalled}; ended {ended}:\n" + "\n".join(outputs)[-6000:])
    return signalled, outputs, [e.returncode for e in ended]


#: Each case: the framework and the world it runs in (Composer only where it is installed).
CASES = [
    pytest.param("lightning", "today", marks=pytest.mark.framework),
    pytest.param("hf", "today", marks=pytest.mark.framework),
    pytest.param("olmo_core", "today", marks=pytest.mark.framework),
    pytest.param("composer", "any", marks=pytest.mark.framework, id="composer"),
    *(
        pytest.param(name, "older", marks=[pytest.mark.framework, pytest.mark.older])
        for name in ("lightning", "hf", "olmo_core")
    ),
]


@pytest.mark.parametrize(("framework", "world"), CASES)
def test_sigterm_to_node_1s_launcher_stops_every_rank_after_one_step_saved_exit_75(
    framework, world, tmp_path
):
    if world != "any" and (world == "older") != OLDER:
        pytest.skip(f"the {world} world's case runs in its own environment")
    needs = NEEDS.get(framework, framework)
    if find_spec(needs) is None:
        pytest.skip(f"needs {needs}")
    signalled, outputs, codes = _launch(framework, tmp_path)
    output = "\n".join(outputs)
    ready = json.loads((tmp_path / "signalled.json").read_text())
    assert ready["step"] == SIGNAL_AT
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    (step,) = {r["step"] for r in ranks}  # every rank stopped after the same step
    assert SIGNAL_AT < step < SIGNAL_AT + 40, ranks
    took = max(r["ended_at"] for r in ranks) - signalled
    assert 0 < took < GRACE_S, took
    # the framework's own save of that step
    missing = [p for p in _checkpoint_parts(framework, tmp_path / "ckpt", step) if not p.exists()]
    assert not missing, (missing, output[-6000:])
    if framework == "hf":
        state = json.loads(_checkpoint_parts("hf", tmp_path / "ckpt", step)[0].read_text())
        assert state["global_step"] == step
    if framework == "composer":
        assert zipfile.is_zipfile(_checkpoint_parts("composer", tmp_path / "ckpt", step)[0])
    # every rank ends through the exit path with 75; each launcher names what it saw
    for rank in (0, 1):
        ended = _rankguard_lines(output, rank, "INFO")
        assert any(f"ending (preempted) with exit code {STOP_EXIT_CODE}" in e for e in ended), (
            rank,
            output[-6000:],
        )
    if framework == "composer":  # each launcher names its rank's code and exits with it
        named = [dict(_COMPOSER_CODE.findall(out)) for out in outputs]
        assert named == [{"0": "75"}, {"1": "75"}], output[-6000:]
        assert codes == [STOP_EXIT_CODE, STOP_EXIT_CODE], codes
    else:  # node 1's torchrun, signalled itself, names no rank's code
        named = [dict(_TORCHRUN_CODE.findall(out)) for out in outputs]
        assert named == [{"0": "75"}, {}], output[-6000:]
    # one WARNING per rank, the preemption's, and no rankguard ERROR
    for rank in (0, 1):
        (warning,) = _rankguard_lines(output, rank, "WARNING")
        assert warning.startswith(
            f"rankguard hang_watchdog: Preempted: SIGTERM on rank 1 at step {step}; "
            f"every rank stops after train step {step}"
        ), warning
        assert _rankguard_lines(output, rank, "ERROR") == [], output[-6000:]
    if framework == "lightning":  # rankguard's handler stood in for Lightning's during the fit
        handler = r"SIGTERM already had a handler \(\S*signal_connector\._HandlersCompose"
        assert re.search(rf"\[rank 1\] .*{handler}", output), output[-6000:]
    print(f"{framework} ({world}): every rank stopped after step {step}, {took:.1f} s after")
