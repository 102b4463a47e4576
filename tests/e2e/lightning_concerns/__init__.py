"""The scenarios of ``tests/e2e/lightning_job.py``, a module per concern, and their harness."""
