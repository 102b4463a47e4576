"""Timings and watchdog settings shared by the hang jobs and their tests (no framework import)."""

from __future__ import annotations

#: The healthy runs: eval batches 5x slower than train steps. One eval (4 batches) takes
#: longer than `timeout_s` between two train steps, and longer than the calibrated train
#: deadline, so a watchdog timing train steps alone would fire.
HEALTHY = {
    "timeout_s": 2.0,
    "eval_timeout_s": 2.0,
    "post_eval_timeout_s": 2.0,
    "auto_calibrate": True,
    "warmup_steps": 2,
    "calibration_factor": 10.0,
    "floor_s": 1.0,
    "exchange_period_s": 0.5,
}
TRAIN_STEP_S = 0.12
EVAL_BATCH_S = 0.6

#: The hang runs: only the way back from eval is short (one stage: the 30 s default floor is
#: above every ceiling here).
HANG = {
    "timeout_s": 20.0,
    "eval_timeout_s": 20.0,
    "post_eval_timeout_s": 4.0,
    "exchange_period_s": 0.5,
}

#: The two-stage run: calibrated deadlines from the first steps (2 s floor), reported at
#: stage 1; the after-eval ceiling (8 s) ends the incident (stage 2, exit 75). The factor is
#: 2: the after-eval deadline, not seen yet, is derived as 3 x factor x (train p99 + eval p99)
#: (0.08 s here alone: 2.4 s at the default 10, which a loaded machine's 0.27 s puts at the
#: ceiling; at 2 that takes 1.3 s).
TWO_STAGE = {
    "timeout_s": 20.0,
    "eval_timeout_s": 20.0,
    "post_eval_timeout_s": 8.0,
    "warmup_steps": 0,
    "calibration_factor": 2.0,
    "floor_s": 2.0,
    "exchange_period_s": 0.5,
}
