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
- the framework's own save of that step was written, once;
- every rank ends with 75 through the exit path: each logs it; a launcher names the code
  of a rank it saw end (node 0's torchrun rank 0's; node 1's torchrun, itself signalled,
  none; Composer's launchers each their own rank's, and exit with it);
- each rank logs one rankguard WARNING, "Preempted: SIGTERM on rank 1 at step D", and no
  rankguard ERROR.

Who writes the save at the agreed step differs per case, each run once, in the world whose
release it needs (``tests/e2e/stop_frameworks_job.py``'s variants; Lightning is the same
release in both worlds):

- ``lightning`` (today's world): a ``ModelCheckpoint`` every 1000 steps saves nothing of its
  own there: rankguard writes its file for the step, under its name;
- ``lightning_epoch`` (Composer's world): the ``ModelCheckpoint`` at its defaults saves at
  the epoch's end the stop brings; rankguard adds none;
- ``hf_jit`` (transformers 5): ``save_strategy="no"`` with the just-in-time checkpoint on
  SIGTERM: rankguard's handler stands in for the JIT one and the Trainer saves
  ``checkpoint-D`` at the agreed step (the same ``should_save`` a saving strategy gets);
- ``hf`` (transformers 4.57): ``save_strategy="steps"`` every 1000 steps: ``checkpoint-D``;
- ``olmo_core`` (3.0 and 2.4): the checkpointer's ``post_train`` save, every rank's part;
- ``composer``: the ``CheckpointSaver``'s ``ep0-ba{D}-rank0.pt``.

Composer's FSDP2 sharded save under one launcher, which stops the other ranks once one
exits, is ``test_stop_one_launcher_e2e.py``; the hand-written loop's counterpart of this
file is ``tests/hang/test_stop_nodes.py``.
"""

from __future__ import annotations

import json
import re
import zipfile
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from benchmarks.launch import finish, kill_tree, signal_node, start_nodes
from rankguard.callbacks.hang.stop import STOP_EXIT_CODE
from tests.frameworks.stop_lines import assert_every_rank_preempted
from tests.mp import ROOT

E2E = ROOT / "tests" / "e2e"
SIGNAL_AT = 6
#: The stop's grace (``stop_grace_s``'s default): every rank's fit ended within it of the signal.
GRACE_S = 20.0
#: The harness's limits: far above what a passing run takes (10-50 s on 2 shared cores; over
#: 100 s at a load of 50): until rank 1 is ready, then until every launcher ended.
READY_TIMEOUT_S, LAUNCH_TIMEOUT_S = 180, 300
OLDER = torch.__version__ < "2.8"  # Composer's world (torch 2.7)
#: Each case's job, its arguments (``{out}``: the output folder) and its node launcher.
JOBS = {
    variant: ("stop_frameworks_job.py", [variant, "{out}", "launcher"], "torchrun")
    for variant in ("lightning", "lightning_epoch", "hf", "hf_jit")
} | {
    "olmo_core": ("olmo_core_stop_job.py", ["{out}", "launcher"], "torchrun"),
    "composer": ("composer_stop_job.py", ["{out}", "launcher"], "composer"),
}
#: The module each framework's cases need, by the case's first word.
NEEDS = {"lightning": "lightning", "hf": "transformers", "olmo": "olmo_core"}
#: A launcher's word on a rank's exit code: torchrun's failure summary, Composer's line.
_TORCHRUN_CODE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s+exitcode\s*:\s*(-?\d+)")
_COMPOSER_CODE = re.compile(r"Global rank (\d+) \(PID \d+\) exited with code (-?\d+)")


def _saved(case: str, folder: Path, step: int) -> list[Path]:
    """The files the framework's save of ``step`` writes, every rank's part."""
    if case.startswith("lightning"):  # the ModelCheckpoint's name for the step
        return [folder / f"epoch=0-step={step}.ckpt"]
    if case.startswith("hf"):
        return [folder / f"checkpoint-{step}" / "trainer_state.json"]
    if case == "composer":  # a full (unsharded) checkpoint: rank 0 writes it
        return [folder / f"ep0-ba{step}-rank0.pt"]
    saved = folder / f"step{step}"
    return [
        saved / "model_and_optim" / ".metadata",
        *(saved / "train" / f"rank{r}.pt" for r in (0, 1)),
    ]


def _launch(case: str, out: Path) -> tuple[float, list[str], list[int]]:
    """Two nodes; SIGTERM to node 1's launcher once rank 1 is past step 6.

    Returns the moment of the signal, each launcher's output and exit code.
    """
    script, args, launcher = JOBS[case]
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
        signalled = signal_node(procs, out / "signalled.json", node=1, timeout_s=READY_TIMEOUT_S)
        ended = finish(procs, LAUNCH_TIMEOUT_S if signalled is not None else 5)
    finally:
        for proc in procs:
            kill_tree(proc)
    outputs = [e.stdout for e in ended]
    if signalled is None or any(e.timed_out for e in ended):
        pytest.fail(f"signalled at {signalled}; ended {ended}:\n" + "\n".join(outputs)[-6000:])
    return signalled, outputs, [e.returncode for e in ended]


#: Each case and the world it runs in (Composer only where it is installed).
CASES = [
    pytest.param("lightning", "today", marks=pytest.mark.framework),
    pytest.param("hf_jit", "today", marks=pytest.mark.framework),
    pytest.param("olmo_core", "today", marks=pytest.mark.framework),
    pytest.param("composer", "any", marks=pytest.mark.framework, id="composer"),
    *(
        pytest.param(case, "older", marks=[pytest.mark.framework, pytest.mark.older])
        for case in ("lightning_epoch", "hf", "olmo_core")
    ),
]


@pytest.mark.parametrize(("case", "world"), CASES)
def test_sigterm_to_node_1s_launcher_stops_every_rank_after_one_step_saved_exit_75(
    case, world, tmp_path
):
    if world != "any" and (world == "older") != OLDER:
        pytest.skip(f"the {world} world's case runs in its own environment")
    needs = NEEDS.get(case.split("_")[0], case)
    if find_spec(needs) is None:
        pytest.skip(f"needs {needs}")
    if case == "hf_jit" and version("transformers") < "5":
        pytest.skip("transformers 5's JIT checkpoint")
    signalled, outputs, codes = _launch(case, tmp_path)
    output = "\n".join(outputs)
    ready = json.loads((tmp_path / "signalled.json").read_text())
    assert ready["step"] == SIGNAL_AT
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    (step,) = {r["step"] for r in ranks}  # every rank stopped after the same step
    assert SIGNAL_AT < step < SIGNAL_AT + 40, ranks
    took = max(r["ended_at"] for r in ranks) - signalled
    assert 0 < took < GRACE_S, took
    # the framework's own save of that step, once
    missing = [p for p in _saved(case, tmp_path / "ckpt", step) if not p.exists()]
    assert not missing, (missing, output[-6000:])
    if case.startswith("lightning"):  # one file: Lightning's or rankguard's, never both
        assert ranks[0]["files"] == [f"epoch=0-step={step}.ckpt"], ranks[0]["files"]
    if case.startswith("hf"):
        state = json.loads(_saved(case, tmp_path / "ckpt", step)[0].read_text())
        assert state["global_step"] == step
    if case == "composer":
        assert zipfile.is_zipfile(_saved(case, tmp_path / "ckpt", step)[0])
    # rankguard's handler stood in for the framework's own during the fit
    replaced = {
        "lightning": r"signal_connector\._HandlersCompose",  # Lightning's, set in Trainer.fit
        "hf_jit": r"CheckpointManager\._sigterm_handler",  # the JIT checkpoint's
    }.get("lightning" if case.startswith("lightning") else case)
    if replaced is not None:
        handler = rf"\[rank 1\] .*SIGTERM already had a handler \(\S*{replaced}"
        assert re.search(handler, output), output[-6000:]
    # every rank ends through the exit path with 75, its one WARNING the preemption's
    assert_every_rank_preempted(output, step)
    # each launcher names what it saw
    if case == "composer":  # each launcher names its rank's code and exits with it
        named = [dict(_COMPOSER_CODE.findall(out)) for out in outputs]
        assert named == [{"0": "75"}, {"1": "75"}], output[-6000:]
        assert codes == [STOP_EXIT_CODE, STOP_EXIT_CODE], codes
    else:  # node 1's torchrun, signalled itself, names no rank's code
        named = [dict(_TORCHRUN_CODE.findall(out)) for out in outputs]
        assert named == [{"0": "75"}, {}], output[-6000:]
    print(f"{case} ({world}): every rank stopped after step {step}, {took:.1f} s after")
