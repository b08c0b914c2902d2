"""Stage 8, launch: the run loop, the size plan, the Python API's `probe.run`, torchrun,
interrupts and sweeps."""
