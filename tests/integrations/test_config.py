"""rankguard where users configure training: llm-foundry YAML, LightningCLI YAML, plain dicts."""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import yaml

from rankguard.callbacks import GUARDS
from rankguard.integrations.config import CALLBACK_NAMES, FRAMEWORKS, build_callbacks

ROOT = Path(__file__).resolve().parents[2]


def guard(callback, name):
    return next(g for g in callback.runner.guards if g.name == name)


def test_every_callback_is_an_llmfoundry_entry_point():
    from rankguard.integrations import composer as rg_composer

    found = {ep.name: ep for ep in entry_points(group="llmfoundry_callbacks")}
    assert set(found) == set(CALLBACK_NAMES)
    for name, ep in found.items():
        assert ep.load() is getattr(rg_composer, CALLBACK_NAMES[name])


def test_llmfoundry_yaml_builds_callbacks_as_llmfoundry_does():
    from rankguard.integrations import composer as rg_composer

    # llm-foundry: look the name up in the entry-point group, call it with the YAML kwargs.
    config = yaml.safe_load((ROOT / "examples" / "llmfoundry_callbacks.yaml").read_text())
    registry = {ep.name: ep for ep in entry_points(group="llmfoundry_callbacks")}
    callbacks = [registry[name].load()(**kwargs) for name, kwargs in config["callbacks"].items()]
    (rank_guard,) = callbacks
    assert isinstance(rank_guard, rg_composer.RankGuard)
    assert guard(rank_guard, "batch_parity_guard").eval_end_timeout_s == 300
    assert guard(rank_guard, "shared_dir_barrier").timeout_s == 900


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_build_callbacks_from_a_plain_dict(framework):
    module = importlib.import_module(f"rankguard.integrations.{framework}")
    callbacks = build_callbacks(
        {"rank_guard": {"drop_last_guard": False}, "batch_parity_guard": None}, framework
    )
    assert [type(c) for c in callbacks] == [module.RankGuard, module.BatchParityGuard]
    assert "drop_last_guard" not in [g.name for g in callbacks[0].runner.guards]


def test_unknown_names_and_settings_list_the_valid_ones_with_a_suggestion():
    with pytest.raises(ValueError, match="Did you mean 'rank_guard'"):
        build_callbacks({"rankguard": {}}, "lightning")
    with pytest.raises(ValueError, match="Did you mean 'eval_end_timeout_s'"):
        build_callbacks({"batch_parity_guard": {"eval_end_timeout": 5}}, "lightning")
    with pytest.raises(
        ValueError, match="valid: composer, lightning, olmo_core, torch, transformers"
    ):
        build_callbacks({}, "keras")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_signatures_show_every_setting_to_config_tools(framework):
    module = importlib.import_module(f"rankguard.integrations.{framework}")
    assert list(inspect.signature(module.RankGuard).parameters) == [
        "exchange_timeout_s",
        *GUARDS,
    ]
    params = inspect.signature(module.BatchParityGuard).parameters
    assert params["eval_end_timeout_s"].default == 120.0


def test_lightning_cli_builds_a_single_guard_with_lightnings_defaults():
    """jsonargparse passes every default the signature shows: the class's own, not the core's."""
    jsonargparse = pytest.importorskip("jsonargparse")
    from lightning.pytorch.callbacks import Callback

    from rankguard.integrations import lightning as rg_lightning

    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--callback", type=Callback)
    config = parser.parse_args(["--callback", "rankguard.integrations.lightning.CheckpointPlanner"])
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    (planner,) = instantiate(config).callback.runner.guards
    (direct,) = rg_lightning.CheckpointPlanner().runner.guards
    assert planner.writer == direct.writer == "buffer"


def run_cli(tmp_path, *extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "lightning_cli.py"),
        "fit",
        "--config",
        str(ROOT / "examples" / "lightning_cli.yaml"),
        *extra,
    ]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.framework
def test_lightning_cli_yaml_runs_rankguard_on_two_ranks(tmp_path):
    healthy = run_cli(tmp_path)
    assert healthy.returncode == 0, healthy.stderr[-3000:]
    assert "rankguard" not in healthy.stdout + healthy.stderr
    faulty = run_cli(tmp_path, "--data.uneven_eval", "true")
    assert faulty.returncode != 0
    assert "DataInconsistencyError" in faulty.stderr
    assert "loader 'val': length differs (rank 0: 16 items; rank 1: 32 items)" in faulty.stderr
