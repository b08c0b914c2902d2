"""`python -m probe.plot`: a run's or a sweep's figures (probe.analysis.plot)."""

from probe.analysis.plot import main

if __name__ == "__main__":
    main()
