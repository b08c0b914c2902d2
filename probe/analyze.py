"""`python -m probe.analyze RUN [linear|cka|all|topk]`: linear probes and CKA over a run or a
sweep (probe.analysis.analyze); `topk` draws feature cards, with their own options
(probe.report.cards)."""

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "topk" in argv[1:2]:
        from probe.report.cards import main as cards

        return cards(argv)
    from probe.analysis.analyze import main as analyses

    return analyses(argv)


if __name__ == "__main__":
    sys.exit(main())
