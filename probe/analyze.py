"""`python -m probe.analyze RUN [linear|cka|all|topk|circuit]`: linear probes and CKA over a run or
a sweep (probe.analysis.streamed_analyses); `topk` draws feature cards, with their own options
(probe.report.cards); `circuit` a run's best edges or a sweep's edge x run table
(probe.report.circuits)."""

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "topk" in argv[1:2]:
        from probe.report.cards import main as cards

        return cards(argv)
    if "circuit" in argv[1:2]:
        from probe.report.circuits import main as circuits

        return circuits(argv)
    from probe.analysis.streamed_analyses import main as analyses

    return analyses(argv)


if __name__ == "__main__":
    sys.exit(main())
