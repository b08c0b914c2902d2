"""Launch: the run loop, the size plan, the Python API's `probe.run`, torchrun, interrupts and
sweeps."""
