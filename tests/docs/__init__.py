"""The docs and examples: rendered pages, recordings, the examples' faults."""
