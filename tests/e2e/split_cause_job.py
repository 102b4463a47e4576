"""A DDP loop over a tiny BERT whose ranks split, run with ``RankGuard()`` and a report folder.

Usage::

    torchrun --standalone --nproc-per-node 2 tests/e2e/split_cause_job.py OUT_DIR SCENARIO

- ``skipped_backward``: rank 1's loss is not finite at its sixth batch (train batch 5) and
  the loop does ``if not torch.isfinite(loss): continue``: rank 0 waits in batch 5's
  backward (DDP's gradient all-reduce), rank 1 in batch 6's forward (the buffer broadcast).
- ``uneven_windows``: the loop steps the optimizer once a window holds 16 tokens, counted on
  each rank (``no_sync()`` until then): rank 0's batches hold 8 tokens, rank 1's 6, so rank
  0's second backward all-reduces while rank 1's runs under ``no_sync()``.
- ``uneven_pass``: each rank streams its own shard (an iterable without a length): rank
  0's holds 5 batches, rank 1's 8; rank 0's pass ends first.

The rank whose code splits the ranks writes the moment to ``OUT_DIR/split.json``; reports go
to ``OUT_DIR/reports``. ``E2E_RANKGUARD=off`` runs the same loop without rankguard.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests.e2e.common import VOCAB, rankguard_off, tiny_bert

#: Batches per rank in each scenario, and the tokens of each batch (its attention mask's ones).
BATCHES = {"skipped_backward": (10, 10), "uneven_windows": (10, 10), "uneven_pass": (5, 8)}
TOKENS = {"uneven_windows": (8, 6)}
#: The tokens a window holds before the optimizer steps (``uneven_windows``).
WINDOW_TOKENS = 16


def split_now(out: Path, what: str) -> None:
    """Records the moment this rank's code splits the ranks."""
    said = {"t": time.time(), "rank": dist.get_rank(), "what": what}
    (out / "split.json").write_text(json.dumps(said))


def batches(scenario: str, rank: int) -> list[dict[str, torch.Tensor]]:
    """This rank's batches: 2 sequences of 4 tokens, the attention mask holding ``tokens``."""
    gen = torch.Generator().manual_seed(rank)
    tokens = TOKENS.get(scenario, (8, 8))[rank]
    out = []
    for _ in range(BATCHES[scenario][rank]):
        mask = torch.zeros(2, 4, dtype=torch.long)
        mask.view(-1)[:tokens] = 1
        out.append(
            {
                "input_ids": torch.randint(1, VOCAB, (2, 4), generator=gen),
                "attention_mask": mask,
                "labels": torch.randint(0, 2, (2,), generator=gen),
            }
        )
    return out


def stream(out: Path, items: list[dict[str, torch.Tensor]], rank: int) -> Iterator[dict]:
    """This rank's shard as a stream (no length): rank 0's ends first (``uneven_pass``)."""
    yield from items
    if rank == 0:
        split_now(out, "rank 0's shard ran out")


def train(out: Path, scenario: str, run: Any, model: Any, optimizer: Any, loader: Any) -> None:
    """The loop; ``run.train`` where rankguard runs, the loader itself where it does not."""
    rank = dist.get_rank()
    tokens = 0
    for i, batch in enumerate(run.train(loader) if run is not None else loader):
        tokens += int(batch["attention_mask"].sum())
        sync = scenario != "uneven_windows" or tokens >= WINDOW_TOKENS
        if sync and scenario == "uneven_windows" and rank == 0 and i == 1:
            split_now(out, "rank 0 ends a window of 2 backward passes")
        with contextlib.nullcontext() if sync else model.no_sync():
            loss = model(**batch).loss
            if scenario == "skipped_backward" and rank == 1 and i == 5:
                loss = loss * float("nan")  # a bad batch
                split_now(out, "rank 1 skips batch 5's backward")
            if not torch.isfinite(loss):
                continue
            loss.backward()
        if sync:
            optimizer.step()
            optimizer.zero_grad()
            tokens = 0
        time.sleep(0.05)


def main() -> None:
    out, scenario = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    logging.basicConfig(format=f"%(created).3f [rank {rank}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("rankguard").setLevel(logging.INFO)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = DistributedDataParallel(tiny_bert())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    items = batches(scenario, rank)
    loader = stream(out, items, rank) if scenario == "uneven_pass" else items
    if rankguard_off():
        train(out, scenario, None, model, optimizer, loader)
    else:
        from rankguard.integrations.torch import RankGuard

        guard = RankGuard(hang_watchdog={"report_dir": str(out / "reports")})
        with guard.fit(model, optimizer, loader) as run:
            train(out, scenario, run, model, optimizer, loader)
    (out / f"rank{rank}.json").write_text(json.dumps({"returned": time.time()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
