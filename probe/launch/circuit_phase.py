"""The circuit phase of a run (`circuit.method` set, `dataset=pairs`): once the run's loop is done,
every method's edge scores over every batch of pairs, then the circuits of `circuit.sizes` cut from
them and evaluated (every edge outside a circuit ablated) over the same batches; rank 0 then
writes `/circuit`, the tables, the figures and MIB's files (probe.circuits.files,
probe.report.circuits).

circuit.* is parsed and its values checked with the run's config (probe.plan's CircuitSpec,
probe.checks.check_circuit); what needs the model and the pairs is checked before the run's loop
(`prepare_circuits`): the dataset, the metric's answers and the model's language-model head,
the methods' order, the sizes, the graph of the model (an unknown family, a post-norm model),
`circuit.max_exact` and the means of `circuit.mean_source`; each check is probe.shared_checks'
or the library's own, so a run and a call from Python say the same.

Scores and evaluations accumulate as float64 sums and counts, saved after every batch to
`circuit_progress.npz` (`circuit_progress.rankR.npz` per rank under torchrun) by an atomic
rename, so a stop (SIGINT, SIGTERM: after the batch in flight) or a kill loses at most that batch
and `resume=true` continues from the next. Under torchrun each rank scores its own block of
batches; after a barrier every rank reads every rank's file and merges the sums (in rank order:
every rank holds the same scores, so cuts the same circuits), evaluates its block, and rank 0
merges the evaluations. The progress files go once `/circuit` is written.
"""

from __future__ import annotations

import io
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from probe.circuits.context import BatchContext
from probe.circuits.cut import check_sizes
from probe.circuits.exact import evaluate
from probe.circuits.faithfulness import plan
from probe.circuits.files import CircuitResult, read, read_means
from probe.circuits.parts import Parts, parts_of
from probe.circuits.scores import EdgeScores, ScoreOptions, check_graph, check_methods, score_batch
from probe.circuits.states import SenderStates, mean_states
from probe.circuits.task import Ablation, AnswerMetric, pair_batch
from probe.data.batches import OrderedBatches
from probe.errors import ConfigError, DataError
from probe.intervene.metrics import check_logits
from probe.launch.interrupt import Interrupted, StopFlag
from probe.plan import CircuitSpec, RunPlan
from probe.shared_checks import check_answers

log = logging.getLogger("probe")
SUMS = ("edge_sum", "edge_sumsq", "node_sum", "node_sumsq")


@dataclass
class CircuitPhase:
    """What the phase needs, checked before the run's loop."""

    spec: CircuitSpec
    parts: Parts
    methods: list[str]
    metric: AnswerMetric
    means: SenderStates | None = None  # circuit.mean_source's

    def choices(self) -> dict:
        """The choices the scores and circuits depend on (stored with them)."""
        s = self.spec
        return {
            "methods": self.methods,
            "steps": s.steps,
            "ablation": s.ablation,
            "mean_source": s.mean_source,
            "metric": s.metric,
            "position": s.position,
            "sizes": list(s.sizes),
            "select": s.select,
            "absolute": s.absolute,
        }


class CircuitInterrupted(Interrupted):
    """The circuit phase was stopped by a signal after `batches` batches of its current pass."""

    def __init__(self, signum: int, what: str, done: int, total: int, progress: Path):
        import signal

        self.signum, self.num_samples, self.path = signum, 0, progress
        Exception.__init__(
            self,
            f"stopped by {signal.Signals(signum).name} while {what} after {done} of {total} "
            f"batches; probe.h5 is complete and {progress.name} holds the sums so far. Run again "
            "with resume=true and the same hydra.run.dir to continue",
        )


def prepare_circuits(plan: RunPlan, model: torch.nn.Module, dataset) -> CircuitPhase | None:
    """The run's circuit phase, what the model and the pairs decide checked (None: circuit.method
    is empty)."""
    spec = plan.circuit
    if not spec.method:
        return None
    methods = check_methods(spec.method, spec.ablation)  # (circuit.method=eap: [eap])
    if "corrupt_ids" not in _fields(dataset):
        raise ConfigError(
            f"circuit.method={methods} scores edges over clean/corrupt pairs: give "
            "dataset=pairs dataset.path=PAIRS, or leave circuit.method empty"
        )
    metric = AnswerMetric(spec.metric, spec.position)
    check_answers(f"circuit.metric={metric.name}", metric.name, _fields(dataset))
    check_logits(model, f"circuit.metric={metric.name}")
    if spec.sizes:
        check_sizes(spec.sizes)
    parts = parts_of(model)  # an unknown family or a post-norm model is named here
    check_graph(
        methods, parts.graph, ScoreOptions(spec.steps, spec.max_exact)
    )  # (once: no batch changes the edges)
    means = _source_means(spec.mean_source, parts) if spec.mean_source else None
    return CircuitPhase(spec, parts, methods, metric, means)


def _fields(dataset) -> set[str]:
    return {k for k in ("corrupt_ids", "answer", "wrong") if getattr(dataset, k, None) is not None}


def _source_means(source: str, parts: Parts) -> SenderStates:
    """The node means an earlier run with circuit.ablation=mean stored in /circuit/means."""
    import h5py

    path = Path(source)
    path = path / "probe.h5" if path.is_dir() else path
    way_out = (
        "give the directory of an earlier run made with circuit.ablation=mean on this model, or "
        "leave circuit.mean_source unset to average over this run's pairs"
    )
    if not path.is_file():
        raise ConfigError(f"circuit.mean_source={source!r}: no probe.h5 there; {way_out}")
    with h5py.File(path, "r") as f:
        if "circuit/means" not in f:
            raise ConfigError(f"circuit.mean_source={source!r} holds no node means; {way_out}")
        g = f["circuit"]
        shape = (int(g.attrs["layers"]), int(g.attrs["heads"]), int(g.attrs["width"]))
        want = (parts.graph.layers, parts.graph.heads, parts.width)
        if shape != want:
            raise ConfigError(
                f"circuit.mean_source={source!r} holds the means of a model of (layers, heads, "
                f"width) {shape}, not this one's {want}; {way_out}"
            )
        return read_means(g["means"], parts.graph.layers)


@dataclass
class Progress:
    """The phase's sums so far: batches scored and evaluated, each method's score sums, the
    evaluation's metric sums per circuit (of the circuits whose hash is `plan`)."""

    key: str
    scored: int
    evaluated: int
    scores: dict[str, EdgeScores]
    eval_sum: np.ndarray | None = None
    eval_count: int = 0
    plan: str = ""

    @classmethod
    def new(cls, key: str, phase: CircuitPhase) -> Progress:
        graph = phase.parts.graph
        return cls(key, 0, 0, {m: EdgeScores(graph, m) for m in phase.methods})

    def save(self, path: Path) -> None:
        arrays = {
            "key": np.array(self.key),
            "scored": self.scored,
            "evaluated": self.evaluated,
            "eval_count": self.eval_count,
            "plan": np.array(self.plan),
        }
        for m, s in self.scores.items():
            arrays.update({f"{m}.{k}": getattr(s, k) for k in SUMS})
            arrays[f"{m}.count"] = s.count
        if self.eval_sum is not None:
            arrays["eval_sum"] = self.eval_sum
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        partial = path.with_name(path.name + ".part")
        partial.write_bytes(buffer.getvalue())
        os.replace(partial, path)  # the file is the old sums or the new ones, never half

    @classmethod
    def load(cls, path: Path, phase: CircuitPhase) -> Progress:
        graph = phase.parts.graph
        try:
            with np.load(path) as z:
                a = {k: z[k] for k in z.files}
        except (OSError, ValueError) as e:
            raise DataError(
                f"{str(path)!r} cannot be read ({e}); delete it to score the circuit again"
            ) from None
        scores = {
            m: EdgeScores(graph, m, *(a[f"{m}.{k}"] for k in SUMS), int(a[f"{m}.count"]))
            for m in phase.methods
        }
        return cls(
            str(a["key"]),
            int(a["scored"]),
            int(a["evaluated"]),
            scores,
            a.get("eval_sum"),
            int(a["eval_count"]),
            str(a["plan"]),
        )


def progress_path(run_dir: Path, rank: int, world: int) -> Path:
    return run_dir / ("circuit_progress.npz" if world == 1 else f"circuit_progress.rank{rank}.npz")


def run_circuits(phase: CircuitPhase, p, shard, run_dir: Path, resume: bool) -> CircuitResult:
    """Score, cut and evaluate over this rank's batches (`p`: the run's Prepared); every rank
    returns the merged result."""
    path = progress_path(run_dir, shard.rank, shard.world)
    key = json.dumps(
        {
            **phase.choices(),
            "graph": phase.parts.graph.counts(),
            "batches": len(shard.batches),
            "rank": shard.rank,
            "world": shard.world,
        },
        sort_keys=True,
    )
    state = Progress.new(key, phase)
    if resume and path.is_file():
        state = Progress.load(path, phase)
        if state.key != key:
            raise ConfigError(
                f"resume=true but {path.name} holds the circuit sums of other choices "
                f"({state.key}, now {key}); resume with the same circuit.* settings, or delete "
                f"{path.name} to score again"
            )
        log.info(
            "circuit: resuming after %d scored, %d evaluated batches", state.scored, state.evaluated
        )
    ablation = Ablation(phase.spec.ablation, _means(phase, p, shard))
    total = len(shard.batches)
    state.save(path)  # (a rank without batches too: the others read every rank's file)
    with StopFlag() as stop:
        for i, batch in _batches(p, state.scored):
            ctx = _context(phase, p, batch, ablation)
            for m in phase.methods:
                edges, nodes = score_batch(ctx, m, phase.spec.steps)
                state.scores[m].add(edges, nodes)
            state.scored = i + 1
            state.save(path)
            if stop.requested is not None and state.scored < total:
                raise CircuitInterrupted(stop.requested, "scoring edges", state.scored, total, path)
        scores = _merged_scores(phase, run_dir, shard, state)
        result = CircuitResult(
            phase.parts.graph,
            scores,
            phase.choices(),
            phase.parts.width,
            means=ablation.means if phase.spec.ablation == "mean" else None,
        )
        if not phase.spec.sizes:
            return result
        s = phase.spec
        circuits = plan(
            phase.parts.graph,
            {m: v.edges for m, v in scores.items()},
            s.sizes,
            s.select,
            s.absolute,
            s.metric,
        )
        digest = _digest(circuits.keep)
        if state.plan != digest:
            state.plan, state.evaluated, state.eval_count = digest, 0, 0
            state.eval_sum = np.zeros(len(circuits.keep))
            state.save(path)
        for i, batch in _batches(p, state.evaluated):
            ctx = _context(phase, p, batch, ablation)
            state.eval_sum += evaluate(ctx, circuits.keep).double().sum(1).cpu().numpy()
            state.eval_count += ctx.batch.size
            state.evaluated = i + 1
            state.save(path)
            if stop.requested is not None and state.evaluated < total:
                raise CircuitInterrupted(
                    stop.requested, "evaluating circuits", state.evaluated, total, path
                )
    total_sum, count = _merged_evaluation(run_dir, shard, state)
    if not count:
        raise DataError("circuit: no pairs to evaluate the circuits on")
    result.curves = circuits.curves(total_sum / count)
    result.circuits = {m: circuits.keep[r] for m, r in circuits.rows.items()}
    return result


def _batches(p, start: int):
    """(index, batch dict) of this rank's batches from batch `start` on (those before unread)."""
    b = p.batches
    again = OrderedBatches(b.dataset, b.batch_size, b.loader.num_workers, b.has_targets)
    again.skip(start)
    for i, batch in enumerate(again, start=start):
        yield i, {**batch.inputs, **batch.side}


def _context(phase: CircuitPhase, p, batch: dict, ablation: Ablation) -> BatchContext:
    pairs = pair_batch(phase.parts.model, batch, phase.metric, p.device)
    ctx = BatchContext(phase.parts, pairs, phase.metric, ablation)
    ctx.check()  # the first clean run checks that the writes sum to the final residual
    return ctx


def _means(phase: CircuitPhase, p, shard) -> SenderStates | None:
    """The node means of a mean ablation: circuit.mean_source's, else over every pair's clean
    half (the whole dataset on every rank)."""
    if phase.spec.ablation != "mean":
        return None
    if phase.means is not None:
        return phase.means
    b = p.batches
    dataset = b.dataset.dataset if shard.world > 1 else b.dataset  # (a rank's block: a Subset)
    every = OrderedBatches(dataset, b.batch_size, b.loader.num_workers, b.has_targets)
    batches = ({**x.inputs} for x in every)
    log.info("circuit: the nodes' means over the %d pairs' clean halves", len(dataset))
    return mean_states(phase.parts, batches, device=p.device)


def _digest(keep: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(np.packbits(keep).tobytes() + str(keep.shape).encode()).hexdigest()


def _every_rank(run_dir: Path, shard, phase: CircuitPhase | None = None) -> list[Progress]:
    """Every rank's saved state (after a barrier), in rank order."""
    import torch.distributed as dist

    dist.barrier()
    return [
        Progress.load(progress_path(run_dir, r, shard.world), phase) for r in range(shard.world)
    ]


def _merged_scores(phase, run_dir: Path, shard, state: Progress) -> dict[str, EdgeScores]:
    if shard.world == 1:
        return state.scores
    states = _every_rank(run_dir, shard, phase)
    merged = {}
    for m in phase.methods:
        total = states[0].scores[m]
        for other in states[1:]:
            total = total.merge(other.scores[m])
        merged[m] = total
    return merged


def _merged_evaluation(run_dir: Path, shard, state: Progress):
    if shard.world == 1:
        return state.eval_sum, state.eval_count
    import torch.distributed as dist

    dist.barrier()
    total, count = 0.0, 0
    for r in range(shard.world):
        with np.load(progress_path(run_dir, r, shard.world)) as z:
            total, count = total + z["eval_sum"], count + int(z["eval_count"])
    return total, count


def finish_circuits(result: CircuitResult, run_dir: Path, h5_path: Path, world: int) -> None:
    """Rank 0: /circuit, the tables, the figures, MIB's files; then the progress files go."""
    from probe.circuits.files import write_h5, write_mib, write_tables
    from probe.report.circuits import write_figures

    write_h5(result, h5_path)
    written = [*write_tables(result, run_dir), *write_mib(result, run_dir)]
    written += write_figures(result, run_dir)
    for method, curve in result.curves.items():
        cpr, cmd = curve.areas
        log.info(
            "circuit %s: CPR %.3f, CMD %.3f over sizes %s",
            method,
            cpr,
            cmd,
            ", ".join(f"{s:g}%" for s in curve.sizes),
        )
    named = ", ".join(p.relative_to(run_dir).as_posix() for p in written)  # (mib/METHOD/...)
    log.info("wrote /circuit in %s and %s", h5_path.name, named)
    for r in range(world):
        progress_path(run_dir, r, world).unlink(missing_ok=True)


def reuse(run_dir: Path, h5_path: Path, phase: CircuitPhase) -> CircuitResult | None:
    """The result a finished circuit phase already wrote into probe.h5 with the same choices
    (a resumed run that had finished), else None."""
    if not h5_path.is_file():
        return None
    try:
        result = read(h5_path)
    except DataError:
        return None
    same = json.dumps(result.choices, sort_keys=True) == json.dumps(phase.choices(), sort_keys=True)
    return result if same and result.graph == phase.parts.graph else None
