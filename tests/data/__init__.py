"""Unit tests of DataConsistencyGuard and DataStallMonitor."""
