"""The scenarios of ``tests/e2e/composer_job.py``, a module per concern, and their harness."""
