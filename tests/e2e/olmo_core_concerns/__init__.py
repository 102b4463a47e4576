"""The OLMo-core job's scenarios, a module per concern (``tests/e2e/olmo_core_job.py``)."""
