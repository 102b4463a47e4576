"""What each rank reads: DataConsistencyGuard and DataStallMonitor.

Dataset fingerprints, loader facts, RNG state, the data loader's fetch
window and its workers' errors.
See docs/data.md.
"""
