"""The hang watchdog's parts meet through typed values and public names, in one vocabulary."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from rankguard.callbacks.core.errors import HangDetectedError
from rankguard.callbacks.hang.calibration import IntervalHistory
from rankguard.callbacks.hang.hang_watchdog import HangWatchdog
from rankguard.callbacks.hang.incident_state import IncidentState
from rankguard.callbacks.hang.kinds import Phase
from rankguard.callbacks.hang.watchdog_settings import DEFAULT_PERIOD_S, spread_exchanges
from tools.private_reaches import DEFAULT, reaches


def test_no_part_of_the_hang_package_reaches_into_another_objects_privates():
    found = [
        f"{path.name}:{line}: {text}"
        for path in DEFAULT.rglob("*.py")
        for line, text in reaches(path)
    ]
    assert found == []


def test_the_counter_finds_a_reach_and_leaves_self_the_stdlib_and_named_tuples_alone(tmp_path):
    module = Path(tmp_path) / "module.py"
    module.write_text(
        "import sys\n"
        "def f(self, other, row):\n"
        "    return self._a, other._b, sys._getframe(), row._replace(x=1), other.__dict__\n"
    )
    assert list(reaches(module)) == [(3, "other._b")]
    assert len(list(reaches(module, everything=True))) == 3


def test_a_phase_kind_reads_as_its_name_wherever_it_is_written():
    kind = Phase.POST_EVAL
    assert (str(kind), f"{kind}_timeout_s", repr(kind)) == (
        "post_eval",
        "post_eval_timeout_s",
        "'post_eval'",
    )
    assert kind == "post_eval" and {"post_eval": 1}[kind] == 1
    assert json.dumps({kind: kind}) == '{"post_eval": "post_eval"}'


def test_the_calibration_saved_with_a_checkpoint_holds_plain_strings():
    history = IntervalHistory()
    history.record(Phase.TRAIN, 0.5)
    state = history.state_dict()
    assert {type(k) for k in (*state["recent"], *state["peaks"])} == {str}


def test_the_watchdogs_settings_are_frozen_and_the_guard_keeps_what_was_fitted(tmp_path):
    watchdog = HangWatchdog(report_dir=str(tmp_path))
    settings = watchdog.current_settings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.timeout_s = 1.0  # type: ignore[misc]

    class Channel:
        is_distributed, world_size = True, 16384

    spread = spread_exchanges(settings, Channel(), watchdog.name)  # type: ignore[arg-type]
    assert settings.exchange_period_s == DEFAULT_PERIOD_S < spread.exchange_period_s
    watchdog._adopt(spread)
    assert watchdog.exchange_period_s == watchdog.exchange_timeout_s == 64.0
    watchdog.close()


def test_one_incident_state_counts_reports_once_and_a_recovery_opens_the_next():
    state = IncidentState()
    state.reported_as(HangDetectedError("stage 1"))
    state.reported_as(HangDetectedError("stage 2"))
    state.reached_ceiling()
    state.ended.set()
    assert (state.incidents, state.ceilings_reached, str(state.last_incident)) == (1, 1, "stage 2")
    assert state.decided == (True, True)
    state.recovered()
    assert state.decided == (False, False) and state.incidents == 1
