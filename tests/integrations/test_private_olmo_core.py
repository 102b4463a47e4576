"""Each read of OLMo-core's private names (``rankguard.integrations.private.olmo_core``).

Every function there is called against the installed OLMo-core, in every world
that has one (ai2-olmo-core 3.0 with today's torch, 2.4 beside Composer): a test
here fails when OLMo-core renames or moves what that function reads.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

pytest.importorskip("olmo_core", reason="needs rankguard[olmo-core]")

import olmo_core.distributed.checkpoint as olmo_dist_checkpoint
import olmo_core.train.callbacks as olmo_callbacks
import olmo_core.train.callbacks.checkpointer
import olmo_core.train.checkpoint as olmo_checkpoint
import olmo_core.utils
from olmo_core.train import Trainer

from rankguard.integrations.private import olmo_core as private
from tests.e2e.olmo_core_concerns.harness import build_trainer


def test_attached_trainer_is_none_before_a_trainer_attaches_the_callback(tmp_path):
    assert private.attached_trainer(olmo_callbacks.Callback()) is None
    trainer = build_trainer(tmp_path, {}, eval_sequences=None)
    checkpointer = trainer.callbacks["checkpointer"]
    assert private.attached_trainer(checkpointer) is trainer is checkpointer.trainer


def test_pending_flush_reads_what_the_trainers_next_flush_reduces(tmp_path):
    from olmo_core.train.common import ReduceType

    trainer = build_trainer(tmp_path, {}, eval_sequences=None)
    assert private.pending_flush(trainer) == ({}, {}, None)  # before any metric or flush
    trainer.record_metric("train/x", 1.5, ReduceType.mean)
    metrics, reduce_types, consistent = private.pending_flush(trainer)
    assert [list(values) for values in metrics.values()] == [["train/x"]]
    assert reduce_types == {"train/x": ReduceType.mean} and consistent is None


def test_wrap_metric_flush_wraps_the_trainers_flush_until_its_undo(tmp_path):
    trainer = build_trainer(tmp_path, {}, eval_sequences=None)
    calls: list[str] = []

    def make(flush):
        return lambda *a, **k: calls.append("flush") or flush(*a, **k)

    undo = private.wrap_metric_flush(trainer, make)
    trainer._log_metrics()  # nothing recorded: OLMo-core's flush returns at once
    assert calls == ["flush"] and "_log_metrics" in vars(trainer)
    undo()
    undo()
    assert "_log_metrics" not in vars(trainer)


def test_polled_folder_reads_a_bound_exists_or_a_lambdas_one_path(tmp_path):
    folder = tmp_path / "step1"
    assert private.polled_folder(folder.exists) == str(folder)
    assert private.polled_folder(lambda: folder.exists()) == str(folder)
    other = tmp_path / "other"
    assert private.polled_folder(lambda: folder.exists() and other.exists()) is None
    assert private.polled_folder(lambda: True) is None


def test_olmo_core_checkpoint_folder_polls_go_through_rankguard_and_are_restored(tmp_path):
    # The one reach into OLMo-core's private code: fails if its checkpointer stops polling
    # for step<N>-tmp, its train/ and step<N> with olmo_core.train.checkpoint.wait_for.
    trainer = build_trainer(tmp_path, {}, eval_sequences=None)
    polled: list[str] = []
    unhook = private.route_checkpoint_dir_waits(lambda path: polled.append(path) or True)
    try:
        step = tmp_path / "ckpt" / "step3"
        trainer.checkpointer.save(step, trainer.train_module, {})
    finally:
        unhook()
        unhook()
    assert polled == [f"{step}-tmp", f"{step}-tmp/train", str(step)]
    assert olmo_checkpoint.wait_for is olmo_core.utils.wait_for


def test_olmo_core_without_its_wait_for_is_left_alone(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="rankguard")
    monkeypatch.delattr(olmo_checkpoint, "wait_for")
    monkeypatch.setattr(private, "_NOT_ROUTED", set())
    for _ in range(2):
        private.route_checkpoint_dir_waits(lambda path: True)()
    assert not hasattr(olmo_checkpoint, "wait_for")
    [record] = [r for r in caplog.records if "wait_for" in r.getMessage()]
    assert record.levelno == logging.DEBUG and "olmo_core.train.checkpoint" in record.getMessage()


def _wait_for_callers() -> set[str]:
    """The installed OLMo-core's modules that call ``wait_for`` (the name, not a longer one)."""
    root = Path(olmo_core.__file__).parent
    callers = set()
    for file in root.rglob("*.py"):
        text = file.read_text()
        if re.search(r"(?<![\w.])wait_for\(", text.replace("def wait_for(", "")):
            relative = file.relative_to(root.parent).with_suffix("")
            callers.add(".".join(relative.parts).removesuffix(".__init__"))
    return callers


def test_every_module_where_the_installed_olmo_core_waits_for_a_checkpoint_is_routed():
    # Fails when OLMo-core moves a wait_for (2.4 and 3.0 read: the checkpointer, its callback,
    # distributed.checkpoint's save preparation): add it to WAIT_SITES, "folder" or "rank0".
    assert _wait_for_callers() == set(private.WAIT_SITES)


def test_distributed_checkpoint_save_preparation_polls_its_folder_through_rankguard(tmp_path):
    # 3.0: the DDP train module's save_state_dict_direct; 10 s in both versions.
    polled: list[str] = []
    unhook = private.route_checkpoint_dir_waits(lambda path: polled.append(path) or True)
    try:
        olmo_dist_checkpoint._prepare_env_for_save(str(tmp_path / "model_and_optim"))
    finally:
        unhook()
    assert polled == [str(tmp_path / "model_and_optim")]
    assert olmo_dist_checkpoint.wait_for is olmo_core.utils.wait_for


def test_rank_0s_wait_for_its_last_async_checkpoint_gets_rankguards_timeout(tmp_path):
    # CheckpointerCallback._await_last_checkpoint: rank 0 alone, 10 s; never an exchange.
    callback = build_trainer(tmp_path, {}, eval_sequences=None).callbacks["checkpointer"]
    done: Future = Future()
    done.set_result(None)
    callback._future, callback._latest_checkpoint_path = done, str(tmp_path / "never")
    timeouts: list[float] = []
    folders: list[str] = []
    unhook = private.route_checkpoint_dir_waits(
        lambda path: folders.append(path) or True, lambda t: timeouts.append(t) or 0.6
    )
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match="waiting to finalize checkpoint"):
            callback._await_last_checkpoint()
    finally:
        unhook()
    assert timeouts == [10.0] and folders == []  # OLMo-core's 10 s, replaced by rankguard's
    assert 0.5 < time.monotonic() - started < 5
    assert olmo_callbacks.checkpointer.wait_for is olmo_core.utils.wait_for


def test_olmo_core_reduces_metrics_where_rankguard_checks_them():
    # What hook_metric_flush relies on (private names are read in that one function).
    from olmo_core.train import utils as train_utils

    source = inspect.getsource(Trainer._log_metrics)
    assert "if not self._metrics:" in source and "self.run_bookkeeping_op(" in source
    assert "move_metrics(self._metrics," in source
    assert "reduce_metrics," in source and "self._metrics_reduce_type," in source
    assert "metrics_consistent=self._metrics_consistent" in source
    assert {"metrics", "metrics_reduce_type", "metrics_consistent"} <= set(
        inspect.signature(train_utils.reduce_metrics).parameters
    )
    fields = {f.name for f in dataclasses.fields(Trainer)}
    assert {"_metrics", "_metrics_consistent", "_metrics_reduce_type"} <= fields


def test_the_checkpoint_folder_polls_read_a_bound_exists_or_a_lambda_over_one_path():
    # What polled_folder reads: every wait_for condition in the routed modules.
    root = Path(olmo_core.__file__).parent
    for module in private.WAIT_SITES:
        path = root.parent / (module.replace(".", "/") + ".py")
        if not path.exists():
            path = path.with_suffix("") / "__init__.py"
        for call in re.findall(r"(?<![\w.])wait_for\(\s*([^,]+),", path.read_text()):
            assert call.startswith("lambda") or call.endswith(".exists"), (module, call)
