"""The HF Trainer job's scenarios, a module per concern (``tests/e2e/hf_trainer_job.py``)."""
