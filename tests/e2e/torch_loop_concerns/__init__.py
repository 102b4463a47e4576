"""The loop job's scenarios, a module per concern (``tests/e2e/torch_loop_job.py``)."""
