"""CheckpointPlanner: a checkpoint save that will not fit in host RAM is known before it runs."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os

import pytest
import torch

from rankguard.callbacks.checkpoint import plan as checkpoint_plan
from rankguard.callbacks.checkpoint.checkpoint_planner import CheckpointPlanner
from rankguard.callbacks.checkpoint.host_memory import (
    cgroup_memory_dirs,
    host_memory_available,
    parse_cgroup_limit,
    parse_inactive_file,
    parse_meminfo,
)
from rankguard.callbacks.checkpoint.plan import RankMemory, plan_save, register_sharded_setting
from rankguard.callbacks.checkpoint.state_size import estimate_state_size, optimizer_state_copies
from rankguard.callbacks.core.errors import CheckpointMemoryError
from rankguard.callbacks.core.events import EventFacts
from rankguard.callbacks.core.side_channel import SideChannel
from tests.mp import run_ranks

GiB, MiB = 1024**3, 1024**2


def _small_model(dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(10, 20), torch.nn.BatchNorm1d(20), torch.nn.Linear(20, 3)
    )
    return model.to(dtype)


def test_estimate_of_small_model_with_adam_matches_hand_count_before_and_after_a_step():
    model = _small_model()
    opt = torch.optim.Adam(model.parameters())
    params = 10 * 20 + 20 + 20 + 20 + 20 * 3 + 3  # two Linears and BatchNorm's weight/bias
    expected_opt = 2 * 4 * params + 4 * 6  # exp_avg + exp_avg_sq in fp32, a 4-byte step per tensor
    before = estimate_state_size(model, opt)
    assert before.params == {"float32": 4 * params}
    assert before.buffers == {"float32": 4 * 40, "int64": 8}  # running mean/var, num_batches
    assert before.optimizer == {"float32": expected_opt}
    assert not before.optimizer_measured and not before.sharded

    model(torch.randn(4, 10)).sum().backward()
    opt.step()
    after = estimate_state_size(model, opt)
    assert after.optimizer_measured
    assert after.optimizer == before.optimizer
    assert after.total == 4 * params + 4 * 40 + 8 + expected_opt


def test_optimizer_state_follows_parameter_dtype_and_optimizer_kind():
    model = _small_model(torch.bfloat16)
    size = estimate_state_size(model, torch.optim.AdamW(model.parameters()))
    assert size.optimizer["bfloat16"] == 2 * size.params["bfloat16"]
    assert optimizer_state_copies(torch.optim.SGD(model.parameters(), lr=0.1)) == 0
    assert optimizer_state_copies(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)) == 1
    assert estimate_state_size(model).optimizer == {}


def _meta_model(params_millions: int) -> torch.nn.Module:
    layers = max(1, round(params_millions * 1e6 / (1024 * 1024)))
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, device="meta") for _ in range(layers)])


def _over_budget(mode: str):
    model = _meta_model(100)  # ~100M fp32 parameters, no memory used: 1.1 GiB with Adam
    planner = CheckpointPlanner(mode=mode, writer="buffer", host_memory_bytes=GiB)
    facts = EventFacts(model=model)
    facts.optimizer = torch.optim.Adam(model.parameters())
    planner.on_fit_start(facts)
    return planner


def test_over_budget_save_warns_with_table_by_default(caplog):
    with caplog.at_level(logging.WARNING):
        planner = _over_budget("warn")
    assert planner.plan.action == "warn"
    assert "Checkpoint save will not fit" in caplog.text
    assert "1.0 GiB (host_memory_bytes)" in caplog.text  # the table
    assert "full save" in caplog.text and "sharded save" in caplog.text


def test_over_budget_save_raises_with_numbers_and_fix():
    with pytest.raises(CheckpointMemoryError) as info:
        _over_budget("raise")
    text = str(info.value)
    assert "needs 1.1 GiB of host memory" in text and "1.0 GiB is available" in text
    assert "host_memory_bytes" in text and "more host memory" in text


def test_auto_cannot_switch_a_single_rank_to_sharded_and_raises_with_setting():
    with pytest.raises(CheckpointMemoryError, match="even a sharded save does not fit"):
        _over_budget("auto")


def test_fitting_save_logs_info_and_plans_ok(caplog):
    model = _small_model()
    planner = CheckpointPlanner(mode="raise")
    with caplog.at_level(logging.INFO):
        planner.on_checkpoint_save_start(EventFacts(model=model))
    assert planner.plan.action == "ok"
    assert "Checkpoint memory fits" in caplog.text


def test_a_sharded_save_estimated_above_the_full_one_says_why_under_the_table():
    # An unsharded model streams its full save one tensor at a time; a sharded save is
    # estimated as a copy of each shard: above the full save for a small model.
    per_rank = {r: RankMemory("host", r, 2048, False, GiB, "MemAvailable", 512) for r in (0, 1)}
    plan = plan_save(per_rank, overhead=0.0)
    (node,) = plan.nodes
    assert (node.full_bytes, node.sharded_bytes) == (512, 2048)
    assert plan.table().splitlines()[-1] == (
        "(A sharded save is estimated as a copy of each rank's shard, 1/world_size of the state; "
        "a full save of this model, which is not sharded, copies one tensor at a time, the "
        "largest: 512 B.)"
    )
    sharded = {r: RankMemory("host", r, 2048, True, GiB, "MemAvailable", 512) for r in (0, 1)}
    assert "(A sharded save" not in plan_save(sharded, overhead=0.0).table()


def _four_ranks(available: int, materialize: str = "rank0", mode: str = "auto", **kwargs):
    per_rank = {
        r: RankMemory(f"host{r // 2}", r % 2, 8 * GiB, True, available, "MemAvailable")
        for r in range(4)
    }
    return plan_save(per_rank, materialize=materialize, overhead=0.0, mode=mode, **kwargs)


def test_plan_counts_the_ranks_that_materialise_the_full_state():
    rank0 = _four_ranks(100 * GiB, "rank0")
    assert [n.full_bytes for n in rank0.nodes] == [8 * GiB, 0]
    assert [n.sharded_bytes for n in rank0.nodes] == [4 * GiB, 4 * GiB]
    every = _four_ranks(100 * GiB, "every_rank")
    assert [n.full_bytes for n in every.nodes] == [16 * GiB, 16 * GiB]
    assert rank0.action == every.action == "ok"


def test_auto_decides_to_switch_to_sharded_when_that_fits_and_the_job_can_switch():
    plan = _four_ranks(6 * GiB, switchable=True)
    assert plan.action == "switch_to_sharded"
    assert "Switching to sharded checkpoints" in plan.reason
    assert "a sharded save needs at most 4.0 GiB per node" in plan.reason
    assert "host0" in plan.table() and "8.0 GiB !" in plan.table()
    assert _four_ranks(6 * GiB, mode="raise", switchable=True).action == "raise"
    assert _four_ranks(6 * GiB, mode="warn", switchable=True).action == "warn"


@pytest.mark.composer  # the fix names every registered framework's setting, Composer's too
def test_auto_raises_naming_the_setting_when_the_job_cannot_switch():
    plan = _four_ranks(6 * GiB, setting="FSDPStrategy(state_dict_type='sharded')")
    assert plan.action == "raise"
    assert "A sharded save would fit (at most 4.0 GiB per node)" in plan.reason
    assert "cannot switch this job to it" in plan.reason
    assert "`FSDPStrategy(state_dict_type='sharded')`" in plan.reason
    assert "Composer" not in plan.reason  # the job's own framework only
    unsharded = {
        r: RankMemory(f"host{r}", 0, 8 * GiB, False, 9 * GiB, "MemAvailable", 2 * GiB)
        for r in range(2)
    }
    # Without the job's own setting, the fix names every registered framework's.
    for adapter in ("composer", "lightning"):  # each registers its framework's setting
        importlib.import_module(f"rankguard.integrations.{adapter}")
    plan = plan_save(unsharded, overhead=1.0, mode="auto")
    assert plan.action == "raise"
    # once sharded, each node would gather and buffer its 4 GiB shard: 8 GiB
    assert "A sharded save would fit (at most 8.0 GiB per node)" in plan.reason
    assert "the model is not sharded (a sharded save needs FSDP)" in plan.reason
    assert "Composer: `parallelism_config={'fsdp': {'state_dict_type': 'sharded'}}`" in (
        plan.reason
    )
    assert "Lightning: `FSDPStrategy(state_dict_type='sharded')`" in plan.reason
    # 8 GiB through a buffer plus the largest tensor copied to the host: 10 GiB
    assert "needs 10.0 GiB" in plan.reason and "+ largest tensor 2.0 GiB" in plan.reason


def test_without_a_setting_the_fix_names_the_registered_frameworks_or_none(monkeypatch):
    monkeypatch.setattr(checkpoint_plan, "SHARDED_SETTINGS", {})
    plan = _four_ranks(6 * GiB, mode="raise")
    assert f"shard ({checkpoint_plan.ANY_SHARDED_SETTING}; this needs" in plan.reason
    register_sharded_setting("Zeta", "zeta(sharded=True)")
    register_sharded_setting("Alpha", "alpha.shard()")
    plan = _four_ranks(6 * GiB, mode="raise")
    assert "(Alpha: `alpha.shard()`; Zeta: `zeta(sharded=True)`; this needs" in plan.reason


def test_node_with_no_memory_left_is_the_one_named():
    per_rank = {
        0: RankMemory("host0", 0, 8 * GiB, True, 4 * GiB, "MemAvailable"),
        1: RankMemory("host1", 0, 8 * GiB, True, 0, "cgroup v2 memory.max minus usage"),
    }
    plan = plan_save(per_rank, materialize="every_rank", mode="raise")
    assert plan.action == "raise"
    assert "on node host1" in plan.reason and "0 B is available" in plan.reason


def _switch_recorder(calls: list):
    def switch() -> str:
        calls.append("switched")
        return "set the test's state_dict_type to 'sharded'"

    return switch


def test_auto_switch_is_applied_through_the_adapters_fact_and_said(caplog):
    model = _meta_model(100)  # ~400 MiB of fp32 parameters on the meta device
    calls: list = []
    facts = EventFacts(model=model, switch_to_sharded=_switch_recorder(calls))
    facts.sharded_setting = "the test setting"
    planner = CheckpointPlanner(mode="auto", host_memory_bytes=300 * MiB)
    planner.bind(_FakeTwoNodes())
    with caplog.at_level(logging.WARNING):
        planner.on_fit_start(facts)
    assert calls == ["switched"]
    assert planner.plan.action == "switch_to_sharded"
    assert planner.switched == "set the test's state_dict_type to 'sharded'"
    assert "Done: set the test's state_dict_type to 'sharded'" in caplog.text
    assert "set `the test setting` in the job's configuration" in caplog.text


class _FakeTwoNodes(SideChannel):
    """This rank's report, and a copy of it from a second node (a sharded model's shards)."""

    def __init__(self) -> None:
        super().__init__(None)

    def exchange(self, name, payload, decide, **kwargs):
        other = dataclasses.replace(payload, node="other-node")
        return decide({0: dataclasses.replace(payload, state_sharded=True), 1: other})


def _planned_on_two_nodes(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ["NODE_RANK"], os.environ["LOCAL_RANK"] = str(rank), "0"
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))  # FSDP2: DTensors
    # 16 MiB of fp32 state, gathered and buffered on rank 0 (32 MiB); 16 MiB per node sharded
    planner = CheckpointPlanner(mode="auto", writer="buffer", host_memory_bytes=24 * MiB)
    planner.bind(SideChannel.from_environment(timeout_s=30))
    calls: list = []
    plan = planner.check(model, None, EventFacts(switch_to_sharded=_switch_recorder(calls)))
    return plan.action, [n.node.split("/")[-1] for n in plan.nodes], plan.table(), calls


def test_two_nodes_agree_to_switch_to_sharded_and_each_rank_switches():
    outcomes = run_ranks(_planned_on_two_nodes, 2, timeout_s=60)
    for o in outcomes:
        assert o.error is None, o.error
    assert outcomes[0].value == outcomes[1].value
    action, nodes, _, calls = outcomes[0].value
    assert action == "switch_to_sharded" and nodes == ["node0", "node1"]
    assert calls == ["switched"]


MEMINFO = "MemTotal:       32000000 kB\nMemFree:  1000 kB\nMemAvailable:   20971520 kB\n"


def test_meminfo_and_cgroup_parsing_on_sample_text():
    assert parse_meminfo(MEMINFO) == 20 * GiB
    assert parse_meminfo("MemTotal: 1 kB\n") is None
    assert parse_cgroup_limit("max\n") is None
    assert parse_cgroup_limit("9223372036854771712\n") is None  # cgroup v1 "unlimited"
    assert parse_cgroup_limit("8589934592\n") == 8 * GiB
    assert parse_inactive_file("anon 5\ninactive_file 1024\nactive_file 7\n") == 1024
    assert parse_inactive_file("cache 5\ntotal_inactive_file 2048\n") == 2048
    v2 = cgroup_memory_dirs("0::/job/step_0\n", "/cg")
    assert v2[0] == ("v2", "/cg/job/step_0")
    v1 = cgroup_memory_dirs("5:cpu:/x\n4:memory:/slurm/uid_1/job_7\n", "/cg")
    assert v1[0] == ("v1", "/cg/memory/slurm/uid_1/job_7")


def test_host_memory_is_the_smaller_of_cgroup_headroom_and_memavailable(tmp_path):
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "meminfo").write_text(MEMINFO)
    (tmp_path / "proc" / "self" / "cgroup").write_text("0::/job\n")
    job = tmp_path / "cg" / "job"
    job.mkdir(parents=True)
    (job / "memory.max").write_text(f"{8 * GiB}\n")
    (job / "memory.current").write_text(f"{3 * GiB}\n")
    (job / "memory.stat").write_text(f"anon 1\ninactive_file {GiB}\n")
    memory = host_memory_available(str(tmp_path / "proc"), str(tmp_path / "cg"))
    assert memory.available_bytes == 6 * GiB and memory.source.startswith("cgroup v2")
    (job / "memory.max").write_text("max\n")
    memory = host_memory_available(str(tmp_path / "proc"), str(tmp_path / "cg"))
    assert memory.available_bytes == 20 * GiB and "MemAvailable" in memory.source


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"mode": "error"}, "mode"),
        ({"materialize": "all"}, "materialize"),
        ({"writer": "s3"}, "writer"),
        ({"host_memory_bytes": 0}, "host_memory_bytes"),
        ({"host_memory_bytes": "8G"}, "host_memory_bytes"),
        ({"state_dict_type": "local"}, "state_dict_type"),
    ],
)
def test_constructor_names_the_bad_argument(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        CheckpointPlanner(**kwargs)
