"""Real multi-process runs of every framework (``framework`` mark), by concern."""
