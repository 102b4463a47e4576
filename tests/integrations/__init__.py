"""Each adapter in one process: event order, defaults, the public API, configs."""
