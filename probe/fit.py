"""`python -m probe.fit RUN`: one transcoder per block from a run's captures of each MLP's input
and output (probe.analysis.fit), written as circuit-tracer's transcoder set (config.yaml,
layer_<i>.safetensors) with fit.csv (held-out FVU, L0, dead features and the next-token loss
with each transcoder spliced in, per layer) and held_out.csv (the samples measured); `--kind
clt`: one cross-layer transcoder over every block (probe.analysis.fit.clt), written in
circuit-tracer's CLT layout (config.yaml, W_enc_<i>.safetensors, W_dec_<i>.safetensors) with
fit.csv.

`python -m probe.fit --evaluate SET RUN`: the same measures of a per-layer set someone else
trained (a circuit-tracer YAML or folder) on RUN's samples, printed or written to `--out CSV`."""

import argparse
import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from probe.analysis.fit.clt import CLT_LR
    from probe.analysis.fit.options import LR, LR_WIDTH, PENALTY, FitOptions

    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m probe.fit", description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog=__doc__.split("\n\n")[1].replace("\n", " "),
    )  # fmt: skip
    parser.add_argument("run", type=Path, help="a run directory (or its probe.h5) of token rows")
    parser.add_argument(
        "--kind", default="plt",
        help="plt: a transcoder per block (default); clt: one cross-layer transcoder",
    )  # fmt: skip
    parser.add_argument(
        "--evaluate", type=Path, default=None, metavar="SET",
        help="measure SET (a transcoder-set YAML or folder) on RUN instead of fitting",
    )  # fmt: skip
    parser.add_argument(
        "--all-samples", action="store_true",
        help="--evaluate: measure on every sample of RUN, not only those --seed and "
        "--test-fraction hold out",
    )  # fmt: skip
    parser.add_argument(
        "--no-losses", action="store_true",
        help="fit without the loss columns (ce_*, kl), which build the run's model",
    )  # fmt: skip
    parser.add_argument("--layers", nargs="*", type=int, default=None, help="blocks (default: all)")
    parser.add_argument(
        "--activation", default="relu",
        help="relu (default), jumprelu (to an L0 target), topk or batchtopk (saved as a jumprelu "
        "of its learnt threshold)",
    )  # fmt: skip
    parser.add_argument(
        "--k", type=int, default=None,
        help="topk, batchtopk: active features per row; jumprelu: the L0 target unless "
        "--l0-target (16)",
    )  # fmt: skip
    parser.add_argument(
        "--l0-target", type=float, default=None,
        help="jumprelu: the mean L0 its penalty steers to (--k; --kind clt: each encoder "
        "layer's)",
    )  # fmt: skip
    parser.add_argument("--width", type=int, default=None, help="features (default 8 x d_model)")
    parser.add_argument(
        "--reads",
        default="mlp_in",
        help="mlp_in (default) or resid_mid (mlp_normalized is not captured by a run)",
    )
    parser.add_argument("--skip", action="store_true", help="a skip matrix W_skip too")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, default=None, help="optimizer steps per layer")
    length.add_argument("--epochs", type=float, default=1.0, help="passes over the rows (1)")
    d = FitOptions()
    parser.add_argument(
        "--lr", type=float, default=None,
        help=f"Adam's peak learning rate ({LR:g} x sqrt({LR_WIDTH} / width); --kind clt: "
        f"{_by_activation(CLT_LR)}, x the same)",
    )  # fmt: skip
    parser.add_argument(
        "--lr-warmup", type=float, default=d.lr_warmup,
        help=f"share of the steps the learning rate rises over from 0 ({d.lr_warmup})",
    )  # fmt: skip
    parser.add_argument(
        "--lr-decay", type=float, default=d.lr_decay,
        help=f"share of the steps (the last) it falls over to 0 ({d.lr_decay})",
    )  # fmt: skip
    parser.add_argument(
        "--sparsity", "--l1", type=float, default=None,
        help="penalty coefficient: relu, activation x decoder norm / sqrt(d_out) on rows scaled "
        f"to unit variance ({PENALTY['relu']:g}); jumprelu, (L0 / target - 1)^2 "
        f"({PENALTY['jumprelu']:g}); --kind clt: the same of each encoder layer (relu: its "
        "whole decoder's norm)",
    )  # fmt: skip
    parser.add_argument(
        "--sparsity-warmup", type=float, default=d.sparsity_warmup,
        help=f"share of the steps the penalty rises over from 0 ({d.sparsity_warmup})",
    )  # fmt: skip
    parser.add_argument(
        "--aux-k", type=int, default=None,
        help="topk, batchtopk: dead features AuxK fits the error with (half the output width)",
    )  # fmt: skip
    parser.add_argument(
        "--aux-coefficient", type=float, default=d.aux_coefficient,
        help="AuxK's loss coefficient (1/32; 0: no AuxK)",
    )  # fmt: skip
    parser.add_argument(
        "--dead-rows", type=int, default=d.dead_rows,
        help=f"rows a feature has not fired on for AuxK to count it dead ({d.dead_rows})",
    )  # fmt: skip
    parser.add_argument(
        "--batch-size", type=int, default=d.batch_size, help=f"rows per step ({d.batch_size})"
    )
    parser.add_argument("--test-fraction", type=float, default=0.1, help="held-out samples (0.1)")
    parser.add_argument("--seed", type=int, default=0, help="init, stream order, held-out split")
    parser.add_argument(
        "--threshold", type=float, default=d.threshold,
        help=f"jumprelu: initial threshold ({d.threshold})",
    )  # fmt: skip
    parser.add_argument(
        "--bandwidth", type=float, default=d.bandwidth,
        help=f"jumprelu: STE kernel width ({d.bandwidth})",
    )  # fmt: skip
    parser.add_argument(
        "--keep-special", action="store_true",
        help="train and measure on rows of position 0 and of special tokens too (left out)",
    )  # fmt: skip
    parser.add_argument("--checkpoint-every", type=int, default=200, help="steps (200)")
    parser.add_argument("--mlp", default=None, help="each block's MLP module name (e.g. mlp)")
    parser.add_argument("--norm", default=None, help="resid_mid: the norm before it (e.g. ln_2)")
    parser.add_argument(
        "--workers", type=int, default=None,
        help="layers fitted side by side in processes (default: one per 4 cores, <= layers)",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=None,
        help="default: RUN/transcoders (--kind clt: RUN/clt); --evaluate: the CSV to write "
        "(default: printed)",
    )  # fmt: skip
    parser.add_argument("--resume", action="store_true", help="continue the fit in --out")
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="probe.fit: %(message)s")
    from probe.analysis.fit.fitting import Fit
    from probe.analysis.fit.startup import end as end_startup
    from probe.errors import ConfigError, ProbeError

    run = args.run.parent if args.run.is_file() else args.run
    options = FitOptions(
        activation=args.activation, width=args.width, l0_target=args.l0_target,
        k=args.k if args.k is not None else FitOptions.k,
        reads=args.reads, skip=args.skip, steps=args.steps, epochs=args.epochs, lr=args.lr,
        lr_warmup=args.lr_warmup, lr_decay=args.lr_decay, sparsity=args.sparsity,
        sparsity_warmup=args.sparsity_warmup, aux_k=args.aux_k,
        aux_coefficient=args.aux_coefficient, dead_rows=args.dead_rows,
        batch_size=args.batch_size, test_fraction=args.test_fraction, seed=args.seed,
        threshold=args.threshold, bandwidth=args.bandwidth, checkpoint_every=args.checkpoint_every,
        keep_special=args.keep_special,
    )  # fmt: skip
    try:
        if not (run / "probe.h5").is_file():
            from probe.errors import DataError

            raise DataError(f"{str(args.run)!r} is not a run directory (no probe.h5)")
        if args.evaluate is not None:
            end_startup()
            return evaluate(args, run)
        if args.workers is not None and args.workers < 1:
            raise ConfigError(f"--workers {args.workers}: give 1 or more processes")
        if args.kind == "clt":
            fit = clt_fit(run, args, options)
            end_startup()
            table = fit.run()
        elif args.kind == "plt":
            fit = Fit(run, args.out, options, args.layers, args.resume, args.mlp, args.norm,
                      losses=not args.no_losses)  # fmt: skip
            end_startup()
            table = fit.run(args.workers)
        else:
            raise ConfigError(f"--kind {args.kind!r}; choose plt (per-layer) or clt (cross-layer)")
    except ProbeError as e:
        print(f"probe.fit: error: {e}", file=sys.stderr)
        return 2
    print(table.to_string(index=False))
    print(f"{fit.out / 'config.yaml'}")
    return 0


def _by_activation(values: dict[str, float]) -> str:
    """{activation: value} as "relu, jumprelu 0.01, topk, batchtopk 0.02" (equal values joined)."""
    groups: dict[float, list[str]] = {}
    for activation, value in values.items():
        groups.setdefault(value, []).append(activation)
    return ", ".join(f"{', '.join(names)} {value:g}" for value, names in groups.items())


def clt_fit(run: Path, args, options):
    """The cross-layer fit of `run` (--layers refused by name)."""
    from probe.analysis.fit.clt import CltFit
    from probe.errors import ConfigError

    if args.layers:
        raise ConfigError(
            f"--layers {args.layers} with --kind clt: a cross-layer transcoder spans every block; "
            "leave --layers out"
        )
    return CltFit(run, args.out, options, args.mlp, args.norm, losses=not args.no_losses,
                  resume=args.resume)  # fmt: skip


def evaluate(args: argparse.Namespace, run: Path) -> int:
    """--evaluate SET RUN: the table printed, or written to --out with the samples measured
    beside it (<out>.held_out.csv)."""
    from probe.analysis.fit.evaluation import evaluate_set

    table, samples = evaluate_set(args.evaluate, run, every=args.all_samples,
                                  test_fraction=args.test_fraction, seed=args.seed,
                                  mlp=args.mlp, norm=args.norm,
                                  keep_special=args.keep_special)  # fmt: skip
    if args.out is None:
        print(table.to_string(index=False))
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out, index=False)
    samples.to_csv(args.out.with_suffix(".held_out.csv"), index=False)
    print(args.out)
    return 0


if __name__ == "__main__":
    from probe.analysis.fit.startup import begin as begin_startup

    begin_startup()  # (main() turns the collector back on once the fit is built)
    sys.exit(main())
