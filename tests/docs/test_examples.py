"""Every example runs: healthy runs pass clean, injected faults are caught, every YAML builds.

Each launch is a real 2-rank CPU training (``composer -n 2`` or Lightning's ``ddp``
launcher). Faults are a focused set, one per mechanism: a fit-start check
(``drop_last``), a watchdog abort (``post_eval_hang``), a cross-rank statistic
(``slow_data``) and a plan table (``ckpt_over_memory``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import import_module
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import yaml

from rankguard.callbacks import HANG_EXIT_CODE
from tests.generator import generate
from tests.mp import launcher_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
LAUNCHER = Path(sys.executable).parent / "composer"
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
SEVEN_FAILURES = [
    "uneven_eval",
    "drop_last",
    "unseeded_split",
    "slow_data",
    "post_eval_hang",
    "node_local_ckpt",
    "ckpt_over_memory",
]


def composer_example(tmp_path, *args, per_rank_files=False):
    script = [str(EXAMPLES / "composer_train.py"), "--workdir", str(tmp_path / "work")]
    files = ["--stdout", "rank{rank}.out", "--stderr", "rank{rank}.err"] if per_rank_files else []
    cmd = [str(LAUNCHER), "-n", "2", *files, *script, *args]
    env = {**ENV, **launcher_port()}
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)


def lightning_example(tmp_path, *args):
    script = [str(EXAMPLES / "lightning_train.py"), "--workdir", str(tmp_path / "work")]
    cmd = [sys.executable, *script, *args]
    env = {**ENV, **launcher_port()}
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)


def says_what_the_docs_quote(name, output, workdir=None):
    """The run's rankguard warnings and errors are the ones its recording in docs/outputs holds."""
    (run,) = [run for run in generate.runs() if run.name == name]
    differences = generate.says_otherwise(run, output, workdir)
    assert not differences, f"{name}: run `make docs`:\n" + "\n".join(differences)


def rankguard_warnings(output):
    return [line for line in output.splitlines() if "WARNING rankguard" in line]


@pytest.mark.framework
def test_composer_example_healthy_run_is_clean(tmp_path):
    proc = composer_example(tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "rank 0 trained 8 of its 8 train batches" in output
    assert "training finished" in output
    assert rankguard_warnings(output) == []


@pytest.mark.framework
def test_lightning_example_healthy_run_is_clean_on_both_ranks(tmp_path):
    proc = lightning_example(tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} trained 8 of its 8 train batches" in output
        assert f"rank {rank} evaluated 16 of its 16 eval samples" in output
    assert rankguard_warnings(output) == []


#: What Composer's launcher reports when it stopped rank 0 with SIGTERM (-15).
STOPPED_BY_LAUNCHER = 241
LOGGED_ERROR = "[rank {rank}] ERROR rankguard.callbacks.guard: rankguard {guard}: {message}"


@pytest.mark.framework
def test_composer_example_drop_last_fault_is_caught_and_logged_by_every_rank(tmp_path):
    proc = composer_example(tmp_path, "--fault", "drop_last", per_rank_files=True)
    output = proc.stdout + proc.stderr
    # 1 is rank 0's own exit code; 241 when rank 1 ended first and the launcher stopped rank 0.
    assert proc.returncode in (1, STOPPED_BY_LAUNCHER), output[-3000:]
    assert "DropLastMismatchError" in output
    message = "Loader settings differ between ranks: loader 'train': drop_last: rank 0: True"
    # Every rank logged the error before any rank could exit (rank 1's output is in its file).
    assert LOGGED_ERROR.format(rank=0, guard="drop_last_guard", message=message) in output
    rank1 = (tmp_path / "rank1.err").read_text()
    assert LOGGED_ERROR.format(rank=1, guard="drop_last_guard", message=message) in rank1
    assert "trained" not in output  # stopped at fit start, before any batch
    says_what_the_docs_quote("composer.drop_last.with", output + rank1, tmp_path / "work")


@pytest.mark.framework
def test_composer_example_post_eval_hang_aborts_with_75_and_rank_1_stack(tmp_path):
    proc = composer_example(tmp_path, "--fault", "post_eval_hang")
    output = proc.stdout + proc.stderr
    assert proc.returncode == HANG_EXIT_CODE, output[-3000:]
    assert "rankguard hang_watchdog: Hang:" in output
    assert "after eval of 'eval'" in output and "(deadline 5 s)" in output
    reports = tmp_path / "work" / "rankguard_reports"
    assert "deadline 5 s" in (reports / "summary.txt").read_text()
    # Rank 1's stack file shows where it stopped: the example's injected sleep.
    stacks = (reports / "rank1.txt").read_text()
    assert "composer_train.py" in stacks and "in eval_end" in stacks
    says_what_the_docs_quote("composer.post_eval_hang.with", output, tmp_path / "work")


@pytest.mark.framework
def test_lightning_example_slow_data_names_rank_1_and_finishes(tmp_path):
    proc = lightning_example(tmp_path, "--fault", "slow_data")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    warnings = rankguard_warnings(output)
    assert len(warnings) == 2, warnings  # every rank logs the same verdict
    for line in warnings:
        assert "Data loading cannot keep up on rank 1: " in line
    assert "training finished" in output
    says_what_the_docs_quote("lightning.slow_data.with", output, tmp_path / "work")


@pytest.mark.framework
def test_lightning_example_ckpt_over_memory_stops_before_training_with_the_table(tmp_path):
    proc = lightning_example(tmp_path, "--fault", "ckpt_over_memory")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1  # rank 0 is the launched process itself
    for rank in (0, 1):  # rank 0 kills its children as its error leaves fit: rank 1 logged first
        logged = LOGGED_ERROR.format(rank=rank, guard="checkpoint_planner", message="Checkpoint")
        assert logged + " save will not fit" in output
    assert "CheckpointMemoryError: Checkpoint save will not fit" in output
    assert "and 1.0 MiB is available (host_memory_bytes)" in output
    assert "1.0 MiB (host_memory_bytes)  10.3 MiB !" in output  # the table's row
    assert "trained" not in output
    assert not list((tmp_path / "work" / "checkpoints").glob("*.ckpt"))
    says_what_the_docs_quote("lightning.ckpt_over_memory.with", output, tmp_path / "work")


def test_both_examples_list_every_fault_and_the_catalogue_shows_each():
    sys.path.insert(0, str(EXAMPLES))
    try:
        faults = import_module("faults")
    finally:
        sys.path.remove(str(EXAMPLES))
    assert set(SEVEN_FAILURES) < set(faults.FAULTS)
    catalogue = (ROOT / "docs" / "failures.md").read_text()
    for name in faults.FAULTS:
        for script in ("composer_train.py", "lightning_train.py"):
            assert f"    {name} " in (EXAMPLES / script).read_text() or name == "none"
        assert f"`--fault {name}`" in catalogue


def build_yaml(path):
    """Builds the callbacks of an example YAML the way its tool does."""
    config = yaml.safe_load(path.read_text())
    if "callbacks" in config:  # llm-foundry: entry-point name -> class, YAML kwargs
        registry = {ep.name: ep for ep in entry_points(group="llmfoundry_callbacks")}
        return [registry[name].load()(**kw) for name, kw in config["callbacks"].items()]
    built = []  # LightningCLI: class_path + init_args
    for spec in config["trainer"]["callbacks"]:
        module, _, name = spec["class_path"].rpartition(".")
        built.append(getattr(import_module(module), name)(**spec.get("init_args", {})))
    return built


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_yaml_builds_its_rankguard_callbacks(path):
    callbacks = build_yaml(path)
    assert callbacks
    assert all(type(c).__module__.startswith("rankguard.integrations.") for c in callbacks)


def test_the_loop_and_trainer_examples_offer_every_fault():
    sys.path.insert(0, str(EXAMPLES))
    try:
        faults = import_module("faults")
    finally:
        sys.path.remove(str(EXAMPLES))
    # The Trainer reads an IterableDataset on rank 0 only: no stream of a rank's own.
    # OLMo-core splits one global order of the data between ranks, and builds its own
    # transformer (replica_drift changes the examples' MLP).
    olmo = ["uneven_train", "drop_last", "unseeded_split", "short_stream", "replica_drift"]
    examples = (
        ("torch_loop.py", []),
        ("hf_trainer.py", ["short_stream"]),
        ("olmo_core_train.py", olmo),
    )
    for script, without in examples:
        text = (EXAMPLES / script).read_text()
        missing = [name for name in faults.FAULTS if f"    {name} " not in text]
        assert missing == ["none", *without]
        assert "--no-rankguard" in text


@pytest.mark.framework
def test_loop_example_unseeded_train_test_split_stops_every_rank_before_any_batch(tmp_path):
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2"]
    cmd += [str(EXAMPLES / "torch_loop.py"), "--fault", "unseeded_split"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=180)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    held_out = re.findall(r"rank (\d) holds out samples (\[.*?\])", output)
    assert len(held_out) == 2 and held_out[0][1] != held_out[1][1]  # each rank its own split
    caught = "DataInconsistencyError: Ranks see different data (at fit start): loader 'eval'"
    assert output.count(caught) == 2, output[-3000:]
    assert "trained" not in output  # stopped before any batch
    says_what_the_docs_quote("torch.unseeded_split.with", output)
    # Without rankguard the same split trains each rank on its own data, silently.
    proc = subprocess.run(
        [*cmd, "--no-rankguard"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=180
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert output.count("training finished") == 2 and "rankguard" not in output.lower()


@pytest.mark.framework
def test_trainer_example_unseeded_split_stops_every_rank_as_the_docs_quote(tmp_path):
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2"]
    cmd += [str(EXAMPLES / "hf_trainer.py"), "--workdir", str(tmp_path / "work")]
    proc = subprocess.run(
        [*cmd, "--fault", "unseeded_split"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=180,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    caught = "DataInconsistencyError: Ranks see different data (at fit start): loader 'eval'"
    assert output.count(caught) == 2, output[-3000:]
    says_what_the_docs_quote("hf.unseeded_split.with", output, tmp_path / "work")
