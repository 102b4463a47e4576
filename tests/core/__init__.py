"""Unit tests of the core: the side channel, the guard runner and the guards together."""
