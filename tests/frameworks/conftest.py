"""Each framework's many-scenario launch, once a session, for the tests of every concern.

See ``tests/frameworks/launches.py``: the first test that asks runs the launch, every other
one (any file, any worker) reads what it returned.
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from tests.frameworks import launches


@pytest.fixture(scope="session")
def composer_scenarios(tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    """``composer -n 2`` of :data:`~tests.frameworks.launches.COMPOSER_SCENARIOS`."""
    return launches.shared(tmp_path_factory, "composer", launches.composer_scenarios)


@pytest.fixture(scope="session")
def lightning_scenarios(tmp_path_factory) -> dict[str, Any]:
    """Lightning's ``ddp`` of :data:`~tests.frameworks.launches.LIGHTNING_SCENARIOS`."""
    if find_spec("lightning") is None:  # not imported here: that would only cost seconds
        pytest.skip("needs rankguard[lightning]")
    return launches.shared(tmp_path_factory, "lightning", launches.lightning_scenarios)


@pytest.fixture(scope="session")
def loop_scenarios(tmp_path_factory) -> tuple[Path, str, list[dict]]:
    """torchrun of the loop's :data:`~tests.frameworks.launches.LOOP_SCENARIOS`."""
    return launches.shared(tmp_path_factory, "torch_loop", launches.loop_scenarios)


@pytest.fixture(scope="session")
def hf_scenarios(tmp_path_factory) -> tuple[Path, str, list[dict]]:
    """torchrun of the HF Trainer's :data:`~tests.frameworks.launches.HF_SCENARIOS`."""
    pytest.importorskip("transformers", reason="needs rankguard[transformers]")
    return launches.shared(tmp_path_factory, "hf_trainer", launches.hf_scenarios)


@pytest.fixture(scope="session")
def loop_data_scenarios(tmp_path_factory) -> tuple[str, list[dict]]:
    """torchrun of the loop's data faults, :data:`~tests.frameworks.launches.DATA_SCENARIOS`."""
    return launches.shared(tmp_path_factory, "torch_loop_data", launches.loop_data_scenarios)
