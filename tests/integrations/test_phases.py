"""The parts of a train batch each adapter announces in the step log, from a real one-process fit.

Backward passes and optimizer steps are what the hang watchdog's history reads to say what
split the ranks (docs/hang.md#what-split-them-each-ranks-history): each adapter announces
what its framework's hooks give, in the order they run, and says which at fit start.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.data import DataLoader

from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.core.step_log import (
    BACKWARD,
    BACKWARD_END,
    BACKWARD_OPTIMIZER_STEP,
    BATCH_START,
    FETCH_END_BATCH_START,
    MICROBATCH,
    OPTIMIZER_STEP,
    SUBPHASES,
)
from rankguard.integrations import torch as rg_torch
from tests.e2e.common import Points, cpu_trainer

#: A train batch's start, as :class:`PhaseLog` writes it.
BATCH = "batch"
#: A batch of a loop (Lightning's, Composer's) that steps after its one backward.
STEPPED = [BATCH, BACKWARD, BACKWARD_END, OPTIMIZER_STEP]


class PhaseLog(Guard):
    """Records each train batch's start and its parts, as the step log holds them."""

    name = "phase_log"
    reads_phases = True  # as the hang watchdog: a loop announces its backward passes

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.announced: tuple[str, ...] | None = None

    def on_fit_start(self, facts) -> None:
        self.announced = facts.phases

    def on_fit_end(self, facts) -> None:
        """Nothing: the runner reads the step log to its end before it."""

    def read_steps(self, entries) -> None:
        for _, event, *_ in entries:
            if event in (FETCH_END_BATCH_START, BATCH_START):
                self.parts.append(BATCH)
            elif event in SUBPHASES:
                self.parts.append(event)


def _loop_fit(log: Guard, batches: int = 3, *, checkpointed: bool = False) -> list:
    """A loop's fit of ``batches`` steps; returns what another thread's backward announced."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = rg_torch._LoopGuard([log])
    loader = DataLoader(Points(4 * batches), batch_size=4)
    with guard.fit(model, optimizer, loader) as run:
        for x, y in run.train(loader):
            if checkpointed:  # reentrant activation checkpointing: a backward inside backward
                x = x.requires_grad_()
                hidden = torch.utils.checkpoint.checkpoint(model[0], x, use_reentrant=True)
                out = model[2](model[1](hidden))
            else:
                out = model(x)
            torch.nn.functional.cross_entropy(out, y).backward()
            optimizer.step()
            optimizer.zero_grad()
        elsewhere = threading.Thread(target=lambda: model(x).sum().backward())
        elsewhere.start()
        elsewhere.join()
    return log.parts[:]


def test_loop_announces_each_backward_and_optimizer_step_and_restores_autograd():
    original = torch.autograd.backward
    log = PhaseLog()
    parts = _loop_fit(log)
    assert log.announced == (BACKWARD, BACKWARD_END, OPTIMIZER_STEP)
    assert parts == STEPPED * 3  # another thread's backward is not the loop's
    assert torch.autograd.backward is original


def test_loop_counts_a_backward_inside_a_backward_once():
    log = PhaseLog()
    assert _loop_fit(log, 2, checkpointed=True) == STEPPED * 2


def test_loop_without_a_guard_that_reads_phases_leaves_autograd_alone():
    class Plain(PhaseLog):
        reads_phases = False

    seen = []

    class Spy(Plain):
        def read_steps(self, entries) -> None:
            seen.append(torch.autograd.backward is original)
            super().read_steps(entries)

    original = torch.autograd.backward
    log = Spy()
    assert _loop_fit(log, 2) == [BATCH, BATCH]
    assert log.announced == () and all(seen)


def _lightning_module(manual: bool):
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = not manual
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])
            if not manual:
                return loss
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
            return None

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Module()


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_lightning_announces_backward_and_optimizer_step_in_either_optimization(manual):
    from rankguard.integrations import lightning as rg_lightning

    log = PhaseLog()
    trainer = cpu_trainer(callbacks=[rg_lightning._LightningAdapter([log])])
    trainer.fit(_lightning_module(manual), DataLoader(Points(12), batch_size=4))
    assert log.announced == (BACKWARD, BACKWARD_END, OPTIMIZER_STEP)
    assert log.parts == STEPPED * 3


def test_lightning_accumulation_steps_once_a_window():
    from rankguard.integrations import lightning as rg_lightning

    log = PhaseLog()
    trainer = cpu_trainer(
        callbacks=[rg_lightning._LightningAdapter([log])], accumulate_grad_batches=2
    )
    trainer.fit(_lightning_module(False), DataLoader(Points(16), batch_size=4))
    window = [BATCH, BACKWARD, BACKWARD_END, *STEPPED]
    assert log.parts == window * 2


def test_hf_trainer_announces_each_microbatch_and_the_windows_last_with_its_step(tmp_path):
    pytest.importorskip("transformers", reason="needs rankguard[transformers]")
    from transformers import Trainer, TrainingArguments

    from rankguard.integrations import transformers as rg_hf
    from tests.e2e.common import tiny_bert, token_dataset

    log = PhaseLog()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    callback = rg_hf._TrainerAdapter([log])
    trainer = Trainer(
        model=tiny_bert(), args=args, train_dataset=token_dataset(16), callbacks=[callback]
    )
    trainer.train()
    assert log.announced == (MICROBATCH, BACKWARD_OPTIMIZER_STEP)
    assert log.parts == [BATCH, MICROBATCH, BACKWARD_OPTIMIZER_STEP] * 2


def test_olmo_core_announces_its_optimizer_steps(tmp_path):
    pytest.importorskip("olmo_core", reason="needs rankguard[olmo-core]")
    from rankguard.integrations import olmo_core as rg_olmo
    from tests.e2e.olmo_core_concerns.harness import build_trainer

    log = PhaseLog()
    trainer = build_trainer(tmp_path, {"rankguard": rg_olmo._OlmoCoreAdapter([log])}, steps=3)
    trainer.fit()
    assert log.announced == (OPTIMIZER_STEP,)
    assert log.parts == [BATCH, OPTIMIZER_STEP] * 3


def test_composer_announces_each_microbatchs_backward_and_the_optimizer_step():
    from composer import Trainer
    from composer.models import ComposerClassifier

    from rankguard.integrations import composer as rg_composer

    log = PhaseLog()
    trainer = Trainer(
        model=ComposerClassifier(torch.nn.Linear(4, 2), num_classes=2),
        train_dataloader=DataLoader(Points(16), batch_size=8),
        device_train_microbatch_size=4,
        max_duration="1ep",
        device="cpu",
        progress_bar=False,
        log_to_console=False,
        loggers=[],
        callbacks=[rg_composer._ComposerAdapter([log])],
    )
    trainer.fit()
    trainer.close()
    assert log.announced == (BACKWARD, BACKWARD_END, OPTIMIZER_STEP)
    microbatch = [BACKWARD, BACKWARD_END]
    assert log.parts == [BATCH, *microbatch, *microbatch, OPTIMIZER_STEP] * 2
