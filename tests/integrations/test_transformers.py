"""The Hugging Face Trainer adapter in one process: its events, its decisions, its silence.

The same adapter runs on 2 ranks under ``torchrun`` in ``tests/frameworks/launches.py``.
A 2-layer BERT built from a config; nothing reaches the network.
"""

from __future__ import annotations

import logging
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the hub
pytest.importorskip("transformers", reason="needs rankguard[transformers]")

from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

from rankguard.callbacks.core.events import LoaderFacts
from rankguard.callbacks.core.guard import Guard
from rankguard.integrations import transformers as rg_hf
from rankguard.integrations.private.transformers import LoopPosition
from rankguard.integrations.transformers import RankGuard
from rankguard.integrations.transformers.decisions import next_event, resume_loader, save_after_eval
from rankguard.integrations.transformers.facts import (
    DATA_FIX,
    DISPATCHER,
    RESUME_FIX,
    resume_facts,
    stop_decision,
    train_loader,
)
from tests.e2e.common import EventLog, tiny_bert, token_dataset


def trainer(tmp_path, callback, eval_dataset=None, **args) -> Trainer:
    settings = {
        "output_dir": str(tmp_path / "out"),
        "use_cpu": True,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "max_steps": 4,
        "eval_strategy": "steps",
        "eval_steps": 2,
        "save_strategy": "steps",
        "save_steps": 4,
        "logging_steps": 10,
        "report_to": [],
        "disable_tqdm": True,
        **args,
    }
    return Trainer(
        model=tiny_bert(),
        args=TrainingArguments(**settings),
        train_dataset=token_dataset(16),
        eval_dataset=token_dataset(8) if eval_dataset is None else eval_dataset,
        callbacks=[callback],
    )


def test_trainer_hooks_fire_core_events_in_order(tmp_path):
    log = EventLog()
    loads = LoadLog()
    evals = {"a": token_dataset(8), "b": token_dataset(4)}  # 2 and 1 eval batches
    hf = trainer(tmp_path, rg_hf._TrainerAdapter([log, loads]), eval_dataset=evals)
    hf.train()
    train_step = [
        ("data_fetch_start", 0, None),
        ("data_fetch_end", 0, None),
        ("train_batch_start", 0, None),
        ("train_batch_end", 0, None),
    ]

    def at(step, events):
        return [(e, step, loader) for e, _, loader in events]

    evaluation = [
        # Every eval loader before the first eval batch, from on_step_end.
        ("eval_start", 0, "eval_a"),
        ("eval_start", 0, "eval_b"),
        ("eval_batch_end", 0, "eval_a"),
        ("eval_batch_end", 0, "eval_a"),
        ("eval_end", 0, "eval_a"),
        ("eval_batch_end", 0, "eval_b"),
        ("eval_end", 0, "eval_b"),
    ]
    assert log.events == [
        ("fit_start", 0, None),
        ("epoch_start", 0, "train"),
        *at(0, train_step),
        ("data_fetch_start", 1, None),
        *at(1, train_step[1:]),
        *at(2, evaluation),
        # After eval, the next fetch is announced only by on_step_begin.
        *at(2, train_step),
        ("data_fetch_start", 3, None),
        *at(3, train_step[1:]),
        *at(4, evaluation),
        # The save due at the same step waits for the last eval's end.
        ("checkpoint_save_start", 4, None),
        ("checkpoint_save_end", 4, None),
        ("data_fetch_start", 4, None),
        ("epoch_end", 4, "train"),
        ("fit_end", 4, None),
    ]
    # A resume is checked before the Trainer loads it, by the file train() needs first.
    log.events.clear()
    hf.train(resume_from_checkpoint=True)
    assert log.events[:2] == [("checkpoint_load_start", 0, None), ("fit_start", 0, None)]
    assert loads.paths == [str(tmp_path / "out" / "checkpoint-4" / "trainer_state.json")]


class FitFacts(Guard):
    """Keeps the facts of FIT_START."""

    name = "fit_facts"

    def __init__(self) -> None:
        super().__init__()
        self.facts = None

    def on_fit_start(self, facts) -> None:
        self.facts = facts


def test_fit_start_hands_the_model_the_trainers_wrapper_and_the_optimizer(tmp_path):
    kept = FitFacts()
    hf = trainer(tmp_path, rg_hf._TrainerAdapter([kept]))
    hf.train()
    assert kept.facts.model is hf.model and kept.facts.optimizer is not None
    # One process: the Trainer wraps nothing; under DDP model_wrapped is the wrapper.
    assert kept.facts.data_parallel is hf.model_wrapped


class LoadLog(Guard):
    """Records the load path of every CHECKPOINT_LOAD_START."""

    name = "load_log"

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[str | None] = []

    def on_checkpoint_load_start(self, facts) -> None:
        self.paths.append(facts.load_path)


def test_single_process_training_is_silent_and_logs_rankguard_metrics(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="rankguard")
    guard = RankGuard(hang_watchdog={"exchange_period_s": 0.2}, data_stall_monitor={"interval": 2})
    hf = trainer(tmp_path, guard)
    hf.train()
    assert [r for r in caplog.records if r.name.startswith("rankguard")] == []
    logged = {key for entry in hf.state.log_history for key in entry}
    assert {
        "rankguard/data_wait_s",
        "rankguard/data_wait_fraction",
        "rankguard/checkpoint_needed_bytes",
        "rankguard/shared_dir_wait_s",
    } <= logged
    # SharedDirBarrier made the save's folder before the Trainer wrote into it.
    assert (tmp_path / "out" / "checkpoint-4" / "trainer_state.json").exists()
    guard.close()
    guard.close()


def test_accelerate_sharded_loaders_are_distributed_for_the_content_check():
    # The Trainer's loaders split batches between ranks with Accelerate's BatchSamplerShard
    # (num_processes), not a DistributedSampler: their content must still be compared.
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

    from rankguard.callbacks.data.fingerprint import fingerprint_loader

    data = token_dataset(16)
    batches = BatchSampler(SequentialSampler(data), batch_size=4, drop_last=False)
    shard = BatchSamplerShard(batches, num_processes=2, process_index=0)
    loader = DataLoader(data, batch_sampler=shard)
    fingerprint = fingerprint_loader(loader, sample_items=4)
    assert fingerprint.sharded and fingerprint.content_kind == "items"
    assert not fingerprint_loader(DataLoader(data, batch_size=4), sample_items=4).sharded


def test_stop_decision_reads_should_training_stop_for_the_deadlock_report():
    control = TrainerControl()
    assert stop_decision(control) == {"should_training_stop": False}
    control.should_training_stop = True  # what EarlyStoppingCallback sets, on one rank
    assert stop_decision(control) == {"should_training_stop": True}


def test_a_dispatching_loader_is_not_read_for_data_positions():
    # accelerate's default for an iterable dataset: rank 0 reads every batch and sends each
    # rank its own, so other ranks' dataset positions never move (no resume check of them).
    import torch
    from accelerate.data_loader import DataLoaderDispatcher

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(8))

    dispatcher = DataLoaderDispatcher(Stream(), batch_size=2)
    assert type(dispatcher).__name__ == DISPATCHER
    assert not train_loader(dispatcher).read_by_each_rank
    own = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    assert train_loader(own) == LoaderFacts("train", own, True, read_by_each_rank=True)
    assert train_loader(None) is None


def control(**flags: bool) -> TrainerControl:
    control = TrainerControl()
    for name, value in flags.items():
        setattr(control, name, value)
    return control


@pytest.mark.parametrize("after_step", [True, False])
@pytest.mark.parametrize("evaluate", [True, False])
@pytest.mark.parametrize("save", [True, False])
@pytest.mark.parametrize("log", [True, False])
def test_next_event_after_a_step_or_an_epoch(after_step, evaluate, save, log):
    flags = control(should_evaluate=evaluate, should_save=save, should_log=log)
    expected = (
        "eval"  # a save due as well waits for the eval's on_evaluate
        if evaluate
        else "save"
        if save
        else ("log" if log else "fetch")
        if after_step
        else None
    )
    assert next_event(flags, after_step) == expected
    # on_step_end's inline usual step is exactly the "fetch" case
    usual = not (evaluate or save or log)
    assert (next_event(flags, after_step=True) == "fetch") == usual


def test_save_after_eval_step_then_best_then_none(tmp_path):
    def args(strategy):
        return TrainingArguments(
            output_dir=str(tmp_path),
            save_strategy=strategy,
            eval_strategy="steps",
            load_best_model_at_end=strategy == "best",
            metric_for_best_model="loss",
            use_cpu=True,
            report_to=[],
        )

    assert save_after_eval(control(should_save=True), args("steps")) == "step"
    assert save_after_eval(control(should_save=True), args("best")) == "step"
    assert save_after_eval(control(), args("best")) == "best"
    assert save_after_eval(control(), args("steps")) is None
    assert save_after_eval(control(), args("no")) is None


def test_resume_loader_reads_the_epochs_loader_of_a_loader_each_rank_reads():
    train, skipping = object(), object()
    own = LoaderFacts("train", train, True)
    assert resume_loader(own, skipping) is skipping
    assert resume_loader(own, None) is train
    assert resume_loader(None, skipping) is None
    dispatched = LoaderFacts("train", train, True, read_by_each_rank=False)
    assert resume_loader(dispatched, skipping) is None


def test_resume_facts_name_what_the_resumed_train_restored(tmp_path):
    def args(ignore_data_skip=False):
        out = str(tmp_path / "out")
        return TrainingArguments(
            output_dir=out, ignore_data_skip=ignore_data_skip, use_cpu=True, report_to=[]
        )

    state = TrainerState(global_step=8)
    train, skipping = object(), object()
    own = LoaderFacts("train", train, True)
    saved = tmp_path / "out" / "checkpoint-8"
    saved.mkdir(parents=True)
    (saved / "trainer_state.json").write_text("{}")
    position = LoopPosition(epoch=1, skipped=3, loader=skipping)

    facts = resume_facts(args(), state, (str(saved), True), position, own)
    assert facts.asked == "resume_from_checkpoint=True"
    assert facts.checkpoint == str(saved)
    assert facts.counters == {"global_step": 8, "epoch": 1, "batches skipped": 3}
    assert facts.loader is skipping
    assert facts.folder == str(tmp_path / "out")  # True: the latest in output_dir
    assert facts.restores_rng and (facts.fix, facts.data_fix) == (RESUME_FIX, DATA_FIX)

    # A path asked for, with no trainer_state.json in it: nothing was loaded.
    missing = str(tmp_path / "elsewhere")
    facts = resume_facts(args(True), state, (missing, missing), position, None)
    assert facts.asked == f"resume_from_checkpoint={missing!r}"
    assert facts.checkpoint is None and facts.folder is None and facts.loader is None
    assert facts.counters["batches skipped"] == 0  # ignore_data_skip: none skipped
    unknown = LoopPosition(epoch=-1, skipped=None, loader=None)
    facts = resume_facts(args(), state, (str(saved), str(saved)), unknown, own)
    assert facts.counters == {"global_step": 8, "epoch": -1} and facts.loader is train
