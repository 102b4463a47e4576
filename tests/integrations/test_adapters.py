"""The adapters' contract: every callback builds, closes twice, and is silent at world size 1."""

from __future__ import annotations

import ast
import logging
import signal
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from rankguard.callbacks import GUARDS, Event, EventFacts, Guard
from rankguard.callbacks.core import events as events_module
from rankguard.integrations import lightning as rg_lightning
from rankguard.integrations import torch as rg_torch
from rankguard.integrations import transformers as rg_transformers
from rankguard.integrations._adapter import stop_agreement
from rankguard.integrations._common import class_name
from rankguard.integrations.lightning import facts as lightning_facts
from tests.e2e.common import Points, cpu_trainer

try:  # Composer's world only (tests/conftest.py marks its tests)
    from rankguard.integrations import composer as rg_composer
    from rankguard.integrations.composer import adapter as composer_adapter
    from rankguard.integrations.composer import decisions as composer_decisions
    from rankguard.integrations.composer import facts as composer_facts
except ImportError:
    rg_composer = composer_adapter = composer_decisions = composer_facts = None
try:  # the olmo-core extra
    from rankguard.integrations import olmo_core as rg_olmo_core
except ImportError:
    rg_olmo_core = None

ADAPTERS = [
    m for m in (rg_composer, rg_lightning, rg_torch, rg_transformers, rg_olmo_core) if m is not None
]


def callback_classes(module):
    return [getattr(module, name) for name in [*GUARD_CLASSES, "RankGuard"]]


GUARD_CLASSES = [class_name(name) for name in GUARDS]
#: What an adapter exports besides the callbacks.
EXTRAS = {
    rg_torch: {"EvalLoader", "Run", "TrainLoader"},
    rg_transformers: {"calling_trainer"},
    rg_olmo_core: {"checkpoint_to_load", "hook_metric_flush", "hook_trainer", "save_options"},
}


@pytest.mark.parametrize("module", ADAPTERS, ids=lambda m: m.__name__)
def test_each_adapter_exports_rank_guard_and_every_guard(module):
    exported = set(module.__all__) - EXTRAS.get(module, set())
    assert exported == {*GUARD_CLASSES, "RankGuard"}
    for name in exported:
        cls = getattr(module, name)
        assert cls.__module__ == module.__name__ and cls.__name__ == name
        assert cls.__doc__ and "__init__" in vars(cls)


@pytest.mark.parametrize("module", ADAPTERS, ids=lambda m: m.__name__)
def test_every_callback_closes_twice_safely(module):
    for cls in callback_classes(module):
        callback = cls()
        if module is rg_composer:
            callback.close(None, None)
            callback.close(None, None)
        elif module in (rg_torch, rg_transformers, rg_olmo_core):
            callback.close()
            callback.close()
        else:
            callback.on_exception(None, None, RuntimeError("boom"))
            callback.teardown(None, None, "fit")
            callback.teardown(None, None, "fit")


@pytest.mark.parametrize("module", ADAPTERS, ids=lambda m: m.__name__)
def test_rank_guard_rejects_unknown_guard_names(module):
    with pytest.raises(ValueError, match="Did you mean 'drop_last_guard'"):
        module.RankGuard(droplast_guard={})


def test_lightning_defaults_sit_under_user_settings():
    def planner(callback):
        return next(g for g in callback.runner.guards if g.name == "checkpoint_planner")

    assert planner(rg_lightning.RankGuard()).writer == "buffer"
    assert planner(rg_lightning.RankGuard(checkpoint_planner={"mode": "raise"})).writer == "buffer"
    assert planner(rg_lightning.RankGuard(checkpoint_planner={"writer": "file"})).writer == "file"
    assert planner(rg_torch.RankGuard()).writer == "file"
    names = [g.name for g in rg_lightning.RankGuard(checkpoint_planner=False).runner.guards]
    assert "checkpoint_planner" not in names


def test_every_core_event_is_in_the_documented_table():
    # The module docstring points to the page section that holds the table.
    anchor = events_module.__doc__.split("docs/design.md#")[1].split()[0].rstrip(".")
    page = (Path(__file__).resolve().parents[2] / "docs" / "design.md").read_text()
    headings = [line for line in page.splitlines() if line.startswith("#")]
    heading = next(h for h in headings if anchor.replace("-", " ") in h.lower().replace(":", ""))
    section = page.split(heading, 1)[1].split("\n## ", 1)[0]
    for event in Event:
        assert event.name in section


def test_composer_single_process_fit_is_silent(caplog):
    from composer import Evaluator, Trainer
    from composer.models import ComposerClassifier

    caplog.set_level(logging.WARNING, logger="rankguard")
    trainer = Trainer(
        model=ComposerClassifier(torch.nn.Linear(4, 2), num_classes=2),
        train_dataloader=DataLoader(Points(16), batch_size=4),
        eval_dataloader=Evaluator(label="eval", dataloader=DataLoader(Points(8), batch_size=4)),
        max_duration="1ep",
        device="cpu",
        progress_bar=False,
        log_to_console=False,
        loggers=[],
        callbacks=[rg_composer.RankGuard()],
    )
    trainer.fit()
    trainer.close()
    assert [r for r in caplog.records if r.name.startswith("rankguard")] == []


def _linear_module():
    """A Lightning module of one linear layer, trained with SGD (no validation step)."""
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Module()


def test_lightning_single_process_fit_is_silent(caplog):
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    caplog.set_level(logging.WARNING, logger="rankguard")
    trainer = cpu_trainer(callbacks=[rg_lightning.RankGuard()])
    trainer.fit(Module(), DataLoader(Points(16), batch_size=4), DataLoader(Points(8), batch_size=4))
    assert [r for r in caplog.records if r.name.startswith("rankguard")] == []


def test_lightning_refuses_enforced_drop_last_with_the_fix():
    # Lightning counts an epoch's batches before any hook: a loader shortened from a
    # callback would end the epoch early and silently skip end-of-epoch validation.
    with pytest.raises(ValueError, match=r"DataLoader\(\.\.\., drop_last=True\)"):
        rg_lightning.RankGuard(drop_last_guard={"mode": "enforce"})
    with pytest.raises(ValueError, match="not available under Lightning"):
        rg_lightning.DropLastGuard(mode="enforce")


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda m: m.__name__)
def test_rank_guard_sets_the_exchange_timeout_and_rejects_a_bad_one(adapter):
    assert adapter.RankGuard(exchange_timeout_s=42).runner.timeout_s == 42.0
    assert adapter.RankGuard().runner.timeout_s == 300.0
    with pytest.raises(ValueError, match="`exchange_timeout_s`"):
        adapter.RankGuard(exchange_timeout_s=0)


class Recorder(Guard):
    """A core guard that records the checkpoint events and their facts."""

    name = "recorder"

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, EventFacts]] = []

    def on_checkpoint_load_start(self, facts: EventFacts) -> None:
        self.seen.append(("load", facts))

    def on_checkpoint_save_start(self, facts: EventFacts) -> None:
        self.seen.append(("save", facts))

    def on_checkpoint_save_end(self, facts: EventFacts) -> None:
        self.seen.append(("saved", facts))


def test_composer_load_path_is_read_before_composer_loads_it(tmp_path):
    # Composer loads inside Trainer.__init__ and records State.load_path only afterwards;
    # rankguard reads Trainer.__init__'s `load_path` at BEFORE_LOAD (fails if renamed).
    from composer import Trainer
    from composer.models import ComposerClassifier

    def trainer(model, callbacks, **kwargs):
        return Trainer(
            model=model,
            train_dataloader=DataLoader(Points(8), batch_size=4),
            max_duration="2ba",
            device="cpu",
            progress_bar=False,
            log_to_console=False,
            loggers=[],
            callbacks=callbacks,
            **kwargs,
        )

    torch.manual_seed(0)
    first = trainer(
        ComposerClassifier(torch.nn.Linear(4, 2), num_classes=2),
        [],
        save_folder=str(tmp_path),
        save_interval="2ba",
    )
    first.fit()
    saved = first.state.model.module.weight.detach().clone()
    first.close()
    torch.manual_seed(1)  # other initial weights for the model that resumes
    model = ComposerClassifier(torch.nn.Linear(4, 2), num_classes=2)
    path = str(tmp_path / "ep0-ba2-rank0.pt")
    weights: list[torch.Tensor] = []

    class AtLoad(Recorder):
        def on_checkpoint_load_start(self, facts: EventFacts) -> None:
            super().on_checkpoint_load_start(facts)
            weights.append(model.module.weight.detach().clone())

    recorder = AtLoad()
    resumed = trainer(model, [composer_adapter._ComposerAdapter([recorder])], load_path=path)
    [(kind, facts)] = recorder.seen
    assert kind == "load" and facts.load_path == path
    assert "remote `load_path`" in facts.upload_setting
    assert not torch.equal(weights[0], saved)  # seen before the load...
    assert torch.equal(model.module.weight, saved)  # ...which then happened
    resumed.close()


def test_composer_names_where_a_remote_save_folder_uploads_its_checkpoints():
    from composer.callbacks import CheckpointSaver
    from composer.core import State
    from composer.devices import DeviceCPU
    from composer.loggers import Logger
    from composer.models import ComposerClassifier

    remote = CheckpointSaver(folder="s3://bucket/run/ckpt")  # staged in a local temp folder
    local = CheckpointSaver(folder="ckpt/{run_name}")
    model = ComposerClassifier(torch.nn.Linear(4, 2), num_classes=2)
    state = State(
        model=model, rank_zero_seed=0, run_name="r", device=DeviceCPU(), callbacks=[remote, local]
    )
    try:
        uploads = composer_facts.checkpoint_uploads(state, Logger(state, []))
    finally:
        remote.remote_uploader.upload_executor.shutdown()
    [(folder, target)] = uploads.items()
    assert target == "s3://bucket/run/ckpt"
    assert folder.endswith("/run/ckpt") and not folder.startswith("ckpt")


def test_lightning_every_save_and_resume_pass_through_rankguard(tmp_path):
    # on_save_checkpoint never fires for save_weights_only=True; the wrapped
    # Trainer.save_checkpoint does, before each save, and Strategy.load_checkpoint
    # before a resume. Fails if Lightning stops calling either.
    import inspect

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    assert "trainer.save_checkpoint(" in inspect.getsource(ModelCheckpoint._save_checkpoint)
    assert "strategy.load_checkpoint(" in inspect.getsource(_CheckpointConnector.resume_start)

    def fit(recorder, **kwargs):
        trainer = cpu_trainer(
            max_epochs=kwargs.pop("max_epochs", 1),
            enable_checkpointing=True,
            callbacks=[
                rg_lightning._LightningAdapter([recorder]),
                ModelCheckpoint(
                    dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, save_weights_only=True
                ),
            ],
        )
        trainer.fit(_linear_module(), DataLoader(Points(16), batch_size=4), **kwargs)
        return trainer

    recorder = Recorder()
    trainer = fit(recorder)
    kinds = [kind for kind, _ in recorder.seen]
    assert kinds == ["save", "saved", "save", "saved"]  # steps 2 and 4
    assert [f.directories for k, f in recorder.seen if k == "save"] == [[str(tmp_path)]] * 2
    assert "save_checkpoint" not in vars(trainer)  # unhooked at teardown
    assert "load_checkpoint" not in vars(trainer.strategy)

    resumed = Recorder()
    path = str(tmp_path / "full.ckpt")
    trainer.save_checkpoint(path)  # a full checkpoint (weights-only ones cannot resume)
    fit(resumed, max_epochs=2, ckpt_path=path)
    assert resumed.seen[0][0] == "load" and resumed.seen[0][1].load_path == path


def test_lightning_resume_folder_is_the_checkpoint_folder_a_resume_looked_in():
    resume_folder = lightning_facts.resume_folder
    assert resume_folder(None, ["/ckpt"]) == "/ckpt"  # found no `last` there: started fresh
    assert resume_folder("/ckpt/last.ckpt", ["/ckpt", "/other"]) == "/ckpt"
    assert resume_folder("/elsewhere/x.ckpt", ["/ckpt"]) is None  # a path the user passed
    assert resume_folder(None, []) is None and resume_folder("/ckpt/last.ckpt", []) is None


def test_lightning_loaders_are_named_and_counted_as_lightning_plans_them():
    a, b = DataLoader(Points(4)), DataLoader(Points(4))
    assert lightning_facts._flatten(None, "val") == []
    assert lightning_facts._flatten(a, "train") == [("train", a)]
    assert lightning_facts._flatten([a, b], "val") == [("val/0", a), ("val/1", b)]
    assert lightning_facts._flatten({"x": a}, "val") == [("val/x", a)]
    assert [lightning_facts._planned(n) for n in (None, float("inf"), 3, 3.0)] == [None, None, 3, 3]


def test_composer_loss_rows_are_the_keys_composer_all_reduces_after_a_batch():
    if rg_composer is None:
        pytest.skip("needs rankguard[composer]")
    loss = torch.ones(())

    def names(value):
        (row,) = composer_decisions.loss_rows(value, batch=3)
        assert row.label == 3
        return [name for name, kind in row.names if kind == "sum"]

    assert names(loss) == ["loss/train/total"]
    assert names({"total": loss, "aux": loss}) == ["loss/train/aux", "loss/train/total"]
    # Without "total", Composer sums the terms into one; a tuple's terms are loss0, loss1, ...
    assert names({"ce": loss}) == ["loss/train/ce", "loss/train/total"]
    assert names((loss, loss)) == ["loss/train/loss0", "loss/train/loss1", "loss/train/total"]
    # Compared after every batch: names and lengths, never the tensors (a tuple of
    # vectors compared as tuples would raise "Boolean value of Tensor ... is ambiguous").
    vectors = (torch.ones(3), torch.zeros(3))
    loss_keys = composer_decisions.loss_keys
    assert loss_keys(vectors) == loss_keys((torch.ones(3), loss)) == 2
    assert loss_keys({"total": loss, "aux": loss}) == ("total", "aux")
    assert loss_keys(loss) is None


def test_composer_counts_the_passes_of_a_loader_without_a_distributed_sampler():
    if rg_composer is None:
        pytest.skip("needs rankguard[composer]")
    from torch.utils.data import DistributedSampler

    from rankguard.callbacks.batches.loader_passes import PassCounter

    plain = DataLoader(Points(8), batch_size=4)
    assert composer_decisions.countable(plain)
    assert not composer_decisions.countable(None)
    assert not composer_decisions.countable(PassCounter(plain))  # counted already
    sampler = DistributedSampler(Points(8), num_replicas=2, rank=0)
    assert not composer_decisions.countable(DataLoader(Points(8), sampler=sampler))


def test_composer_resume_names_rank_0s_checkpoint_and_its_folder(tmp_path):
    if rg_composer is None:
        pytest.skip("needs rankguard[composer]")
    (tmp_path / "ep0-ba2-rank0.pt").touch()
    loaded = str(tmp_path / "ep0-ba2-rank{rank}.pt")
    rank0 = str(tmp_path.resolve() / "ep0-ba2-rank0.pt")
    resumed_from = composer_decisions.resumed_from
    assert resumed_from(loaded, "save", "r") == (rank0, str(tmp_path))
    assert resumed_from(loaded, None, "r") == (rank0, None)  # load_path: no folder
    # an autoresume that found nothing to load names its own folder, formatted
    assert resumed_from(None, "ckpt/{run_name}", "r") == (None, "ckpt/r")
    assert resumed_from(None, None, "r") == (None, None)


def test_lightning_catches_the_stop_signals_in_place_of_its_own_handler_during_the_fit(caplog):
    """Lightning registers its SIGTERM handler before ``on_train_start``: rankguard's replaces it.

    Lightning 2.6's handler broadcasts from the signalled rank only (docs/hang.md, "Lightning
    and the HF Trainer"); this fails if Lightning moves its registration after the hook.
    """
    import lightning as L

    class Seen(L.Callback):
        handler = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            Seen.handler = signal.getsignal(signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    guard = rg_lightning.RankGuard()
    caplog.set_level(logging.INFO, logger="rankguard")
    cpu_trainer(callbacks=[guard, Seen()]).fit(
        _linear_module(), DataLoader(Points(16), batch_size=4)
    )
    assert Seen.handler == stop_agreement(guard.runner.guards)._handle
    assert signal.getsignal(signal.SIGTERM) == before
    said = "SIGTERM already had a handler (lightning.pytorch.trainer.connectors.signal_connector"
    assert said in caplog.text
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_transformers_catches_the_stop_signals_during_the_fit_and_restores_them(tmp_path):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from tests.e2e.common import tiny_bert, token_dataset

    class Seen(TrainerCallback):
        handler = None

        def on_step_end(self, args, state, control, **kwargs):
            Seen.handler = signal.getsignal(signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    guard = rg_transformers.RankGuard()
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=2, save_strategy="no", report_to=[]
    )
    Trainer(
        model=tiny_bert(), args=args, train_dataset=token_dataset(8), callbacks=[guard, Seen()]
    ).train()
    assert Seen.handler == stop_agreement(guard.runner.guards)._handle
    assert signal.getsignal(signal.SIGTERM) == before


INTEGRATIONS = Path(rg_torch.__file__).resolve().parent
#: The base that makes the runner, and the driver that holds it: the one door to the guards.
DOOR = {"_adapter.py", "_driver.py"}


def _runner_reaches(path: Path) -> list[str]:
    """Each ``x.runner`` (and ``GuardRunner`` named) in a module, as ``file:line``."""
    tree = ast.parse(path.read_text())
    found = [
        node.lineno
        for node in ast.walk(tree)
        if (isinstance(node, ast.Attribute) and node.attr == "runner")
        or (isinstance(node, ast.Name) and node.id == "GuardRunner")
    ]
    return [f"{path.relative_to(INTEGRATIONS)}:{line}" for line in found]


def test_adapters_reach_the_guards_only_through_their_driver():
    modules = [p for p in INTEGRATIONS.rglob("*.py") if p.name not in DOOR]
    assert len(modules) > 20  # every integration's package is scanned
    reaches = [r for path in sorted(modules) for r in _runner_reaches(path)]
    assert reaches == [], reaches


def test_the_driver_finds_the_guards_says_what_they_handle_and_carries_their_state():
    guard = rg_torch.ResumeGuard()
    driver = guard.driver
    assert [g.name for g in driver.guards] == ["resume_guard"]
    assert driver.handles(Event.RESUMED) and not driver.handles(Event.EVAL_BATCH_END)
    assert driver.steps is guard.runner.steps  # the hot path: one step log
    assert driver.state_dict() == guard.state_dict() == guard.runner.state_dict()
    guard.close()
    driver.close()  # twice: safe
