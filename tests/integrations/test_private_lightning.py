"""Every private name of Lightning rankguard reads (``rankguard.integrations.private.lightning``).

Each test calls one reach against the installed Lightning and fails if Lightning renames
or moves what it reads. Runs in every world Lightning lives in (today's and Composer's).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.utils.data import DataLoader

from tests.e2e.common import Points, cpu_trainer

L = pytest.importorskip("lightning")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import (  # noqa: E402
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
)

from rankguard.integrations.lightning import RankGuard  # noqa: E402
from rankguard.integrations.lightning.facts import checkpoint_format, split_decisions  # noqa: E402
from rankguard.integrations.private import lightning as private  # noqa: E402


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_saves_sharded_reads_and_switch_to_sharded_sets_what_each_strategy_saves_by():
    fsdp = FSDPStrategy(state_dict_type="full")
    assert private.saves_sharded(fsdp) is False
    assert private.switch_to_sharded(fsdp) == "set FSDPStrategy._state_dict_type to 'sharded'"
    assert private.saves_sharded(fsdp) is True
    assert private.saves_sharded(FSDPStrategy(state_dict_type="sharded")) is True
    assert "self._state_dict_type" in inspect.getsource(FSDPStrategy.save_checkpoint)

    parallel = ModelParallelStrategy(save_distributed_checkpoint=False)
    assert private.saves_sharded(parallel) is False
    assert private.switch_to_sharded(parallel) == (
        "set ModelParallelStrategy._save_distributed_checkpoint to True"
    )
    assert private.saves_sharded(parallel) is True
    assert "self._save_distributed_checkpoint" in inspect.getsource(
        ModelParallelStrategy.save_checkpoint
    )

    assert private.saves_sharded(DDPStrategy()) is None
    with pytest.raises(ValueError, match="cannot save sharded"):
        private.switch_to_sharded(DDPStrategy())
    # The adapter's fact: the format, the switch, and the setting named in messages.
    assert checkpoint_format(DDPStrategy())[:2] == ("full", None)
    full = ModelParallelStrategy(save_distributed_checkpoint=False)
    now, switch, setting = checkpoint_format(full)
    assert (now, setting) == ("full", "ModelParallelStrategy(save_distributed_checkpoint=True)")
    assert switch is not None and "to True" in switch()
    assert checkpoint_format(full)[0] == "sharded"
    assert checkpoint_format(FSDPStrategy())[2] == "FSDPStrategy(state_dict_type='sharded')"


def test_synced_metric_names_read_the_running_steps_logged_names():
    seen = []

    class Logging(Module):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("synced", loss, sync_dist=True)
            self.log("local", loss)
            if batch_idx == 1:
                self.trainer.should_stop = True
            results = self.trainer._results.values()
            names = {m.meta.name: m.meta.sync.should for m in results}
            seen.append((private.synced_metric_names(self.trainer), names))
            seen.append(split_decisions(self.trainer))
            return loss

    cpu_trainer().fit(Logging(), DataLoader(Points(16), batch_size=4))
    # One process: Lightning syncs nothing (sync_dist only applies when distributed); the
    # 2-rank run in tests/frameworks/test_deadlock_e2e.py reads the synced key.
    assert seen[0] == ([], {"synced": False, "local": False})
    assert seen[1] == {"should_stop": False, "sync_dist_keys": (), "sync_dist_loop": "train"}
    assert seen[3] == {"should_stop": True, "sync_dist_keys": (), "sync_dist_loop": "train"}


def test_synced_metric_names_of_a_trainer_that_logged_nothing_yet():
    assert private.synced_metric_names(cpu_trainer()) == []


def test_next_batch_index_is_the_batch_a_resumed_epoch_starts_at(tmp_path):
    seen = []

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen.append(("start", private.next_batch_index(trainer)))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((batch_idx, private.next_batch_index(trainer)))

    def fit(**kwargs):
        every_2 = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
        trainer = cpu_trainer(enable_checkpointing=True, callbacks=[Probe(), every_2])
        trainer.fit(Module(), DataLoader(Points(16), batch_size=4), **kwargs)

    fit()
    assert seen == [("start", 0), (0, 1), (1, 2), (2, 3), (3, 4)]
    seen.clear()
    fit(ckpt_path=str(tmp_path / "epoch=0-step=2.ckpt"))
    assert seen == [("start", 2), (2, 3), (3, 4)]


@pytest.mark.parametrize("automatic", [True, False])
def test_step_tracker_reads_global_step_in_either_optimization(automatic):
    """The step log gets ``global_step`` at every batch, through the tracker."""
    logged: list[tuple[int, int]] = []  # (global_step, the step the log got) at each batch end

    class Stepping(Module):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = automatic

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if not automatic and batch_idx % 2 == 0:  # a step every other batch
                optimizer = self.optimizers()
                optimizer.zero_grad()
                self.manual_backward(loss)
                optimizer.step()
            return loss

    class Probe(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            assert private.step_tracker(trainer) is not None
            steps = guard.runner.steps
            entry = steps.entries[-1] if steps.entries else None
            logged.append((trainer.global_step, None if entry is None else entry[2]))

    guard = RankGuard(hang_watchdog=False)
    trainer = cpu_trainer(max_epochs=2, callbacks=[guard, Probe()])
    trainer.fit(Stepping(), DataLoader(Points(16), batch_size=4))
    assert len(logged) == 8
    steps_taken = [global_step for global_step, _ in logged]
    assert steps_taken == (list(range(1, 9)) if automatic else [1, 1, 2, 2, 3, 3, 4, 4])
    assert [step for _, step in logged] == steps_taken  # each batch end's entry


def test_step_tracker_is_none_where_the_loops_are_built_otherwise():
    class Trainer:  # no fit loop: global_step itself is read
        global_step = 0

    assert private.step_tracker(Trainer()) is None
