"""The circuit pass of a run (`circuit.method` set, `dataset=pairs`): after the run's loop, over
the run's batches again (probe.launch.replay), every method's edge scores over every batch of
pairs, then the circuits of `circuit.sizes` cut from them and evaluated (every edge outside a
circuit ablated) over the same batches; then `/circuit` through the run's sink, and at the
finish the tables, the figures and MIB's files (probe.circuits.files, probe.report.circuits).

circuit.* is parsed and its values checked with the run's config (probe.plan's CircuitSpec,
probe.checks.check_circuit); its methods are checked against the registry before the model is
built (probe.circuits.scores.check_methods), and what needs the model and the pairs before the
run's loop (`prepare_circuits`): the dataset, the metric's answers and the model's
language-model head, the sizes, the component graph of the model (an unknown family, a
post-norm model), `circuit.max_exact` and the means of `circuit.mean_source`; each check is
probe.shared_checks' or the library's own, so a run and a call from Python say the same.

Scores and evaluations accumulate as float64 sums and counts, saved after every batch as the
pass's state in the run's file (probe.store.pass_state, `/passes/circuit`), so a stop (SIGINT,
SIGTERM: after the batch in flight) or a kill loses at most that batch and `resume=true`
continues from the next. Under torchrun each rank scores its own block of batches; the ranks'
sums are then gathered (in rank order: every rank holds the same scores, so cuts the same
circuits), each rank evaluates its block, and the evaluations are gathered likewise; every rank
writes the same `/circuit`, and the stitch takes rank 0's. The state goes once `/circuit` is
written.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from probe.circuits.context import BatchContext
from probe.circuits.cut import check_sizes
from probe.circuits.exact import evaluate
from probe.circuits.faithfulness import plan
from probe.circuits.files import GROUP, CircuitResult, read_group, read_means, write_circuit
from probe.circuits.parts import Parts, parts_of
from probe.circuits.scores import EdgeScores, ScoreOptions, check_graph, check_methods, score_batch
from probe.circuits.states import SenderStates, mean_states
from probe.circuits.task import Ablation, AnswerMetric, pair_batch
from probe.data.batches import Batch
from probe.errors import ConfigError, DataError
from probe.intervene.metrics import check_logits
from probe.launch.distributed import Shard, gathered
from probe.launch.replay import Replay
from probe.plan import CircuitSpec, RunPlan
from probe.shared_checks import check_answers
from probe.store.pass_state import PassState
from probe.store.sink import Sink

log = logging.getLogger("probe")
SUMS = ("edge_sum", "edge_sumsq", "node_sum", "node_sumsq")
STATE = "circuit"  # the pass's state in the run's file: /passes/circuit


@dataclass
class CircuitPass:
    """What the pass needs, checked before the run's loop."""

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


def prepare_circuits(plan: RunPlan, model: torch.nn.Module, dataset) -> CircuitPass | None:
    """The run's circuit pass, what the model and the pairs decide checked (None:
    circuit.method is empty)."""
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
    return CircuitPass(spec, parts, methods, metric, means)


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
    """The pass's sums so far: batches scored and evaluated, each method's score sums, the
    evaluation's metric sums per circuit (of the circuits whose hash is `plan`)."""

    key: str
    scored: int
    evaluated: int
    scores: dict[str, EdgeScores]
    eval_sum: np.ndarray | None = None
    eval_count: int = 0
    plan: str = ""

    @classmethod
    def new(cls, key: str, cp: CircuitPass) -> Progress:
        graph = cp.parts.graph
        return cls(key, 0, 0, {m: EdgeScores(graph, m) for m in cp.methods})

    def save(self, state: PassState) -> None:
        arrays: dict[str, object] = {
            "key": self.key,
            "scored": self.scored,
            "evaluated": self.evaluated,
            "eval_count": self.eval_count,
            "plan": self.plan,
        }
        for m, s in self.scores.items():
            arrays.update({f"{m}.{k}": getattr(s, k) for k in SUMS})
            arrays[f"{m}.count"] = s.count
        if self.eval_sum is not None:
            arrays["eval_sum"] = self.eval_sum
        state.save(arrays)

    @classmethod
    def load(cls, state: PassState, cp: CircuitPass) -> Progress | None:
        a = state.load()
        if a is None:
            return None
        graph = cp.parts.graph
        try:
            scores = {
                m: EdgeScores(
                    graph,
                    m,
                    **{k: np.asarray(a[f"{m}.{k}"]) for k in SUMS},
                    count=int(a[f"{m}.count"]),
                )
                for m in cp.methods
            }
        except KeyError:  # (other methods: the key says so)
            scores = {m: EdgeScores(graph, m) for m in cp.methods}
        eval_sum = a.get("eval_sum")
        return cls(
            str(a["key"]),
            int(a["scored"]),
            int(a["evaluated"]),
            scores,
            None if eval_sum is None else np.asarray(eval_sum),
            int(a["eval_count"]),
            str(a["plan"]),
        )


def run_circuits(cp: CircuitPass, replay: Replay, sink: Sink, device: torch.device,
                 resume: bool) -> CircuitResult:  # fmt: skip
    """Score, cut and evaluate over this rank's batches, writing the pass's state after every
    batch and `/circuit` at the end through `sink`; every rank returns the merged result."""
    shard = replay.shard
    state_file = sink.pass_state(STATE)
    total = len(replay)
    key = json.dumps(
        {
            **cp.choices(),
            "graph": cp.parts.graph.counts(),
            "batches": total,
            "rank": shard.rank,
            "world": shard.world,
        },
        sort_keys=True,
    )
    state = Progress.new(key, cp)
    loaded = Progress.load(state_file, cp) if resume else None
    if loaded is not None:
        if loaded.key != key:
            raise ConfigError(
                f"resume=true but {sink.path.name} holds the circuit sums of other choices "
                f"({loaded.key}, now {key}); resume with the same circuit.* settings, or start "
                "a new run (overwrite=true or a new hydra.run.dir)"
            )
        state = loaded
        log.info(
            "circuit: resuming after %d scored, %d evaluated batches", state.scored, state.evaluated
        )
    ablation = Ablation(cp.spec.ablation, _means(cp, replay, device))
    for i, batch in replay.batches(state.scored):
        ctx = _context(cp, batch, ablation, device)
        for m in cp.methods:
            edges, nodes = score_batch(ctx, m, cp.spec.steps)
            state.scores[m].add(edges, nodes)
        state.scored = i + 1
        state.save(state_file)
        replay.check("scoring edges", state.scored, total)
    scores = _merged_scores(cp, shard, state)
    result = CircuitResult(
        cp.parts.graph,
        scores,
        cp.choices(),
        cp.parts.width,
        means=ablation.means if cp.spec.ablation == "mean" else None,
    )
    if cp.spec.sizes:
        _evaluate(cp, replay, result, state, state_file, ablation, device)
    sink.write_whole(GROUP, lambda f: write_circuit(result, f))
    state_file.drop()
    return result


def _evaluate(cp: CircuitPass, replay: Replay, result: CircuitResult, state: Progress,
              state_file: PassState, ablation: Ablation, device: torch.device) -> None:  # fmt: skip
    """The circuits of circuit.sizes cut from the merged scores, evaluated over this rank's
    batches (the sums saved after each), their curves into `result`."""
    s = cp.spec
    circuits = plan(
        cp.parts.graph,
        {m: v.edges for m, v in result.scores.items()},
        s.sizes,
        s.select,
        s.absolute,
        s.metric,
    )
    digest = hashlib.sha256(
        np.packbits(circuits.keep).tobytes() + str(circuits.keep.shape).encode()
    ).hexdigest()
    if state.plan != digest:
        state.plan, state.evaluated, state.eval_count = digest, 0, 0
        state.eval_sum = np.zeros(len(circuits.keep))
        state.save(state_file)
    total = len(replay)
    for i, batch in replay.batches(state.evaluated):
        ctx = _context(cp, batch, ablation, device)
        state.eval_sum += evaluate(ctx, circuits.keep).double().sum(1).cpu().numpy()
        state.eval_count += ctx.batch.size
        state.evaluated = i + 1
        state.save(state_file)
        replay.check("evaluating circuits", state.evaluated, total)
    sums = gathered(replay.shard, (state.eval_sum, state.eval_count))
    total_sum = sum(a for a, _ in sums)
    count = sum(n for _, n in sums)
    if not count:
        raise DataError("circuit: no pairs to evaluate the circuits on")
    result.curves = circuits.curves(total_sum / count)
    result.circuits = {m: circuits.keep[r] for m, r in circuits.rows.items()}


def _context(
    cp: CircuitPass, batch: Batch, ablation: Ablation, device: torch.device
) -> BatchContext:
    pairs = pair_batch(cp.parts.model, {**_pair_inputs(batch), **batch.side}, cp.metric, device)
    ctx = BatchContext(cp.parts, pairs, cp.metric, ablation)
    ctx.check()  # the first clean run checks that the writes sum to the final residual
    return ctx


def _means(cp: CircuitPass, replay: Replay, device: torch.device) -> SenderStates | None:
    """The node means of a mean ablation: circuit.mean_source's, else over every pair's clean
    half (the whole dataset on every rank)."""
    if cp.spec.ablation != "mean":
        return None
    if cp.means is not None:
        return cp.means
    batches = ({**_pair_inputs(x)} for x in replay.whole_dataset())
    log.info("circuit: the nodes' means over every pair's clean half")
    return mean_states(cp.parts, batches, device=device)


def _pair_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    """A pairs batch's inputs: its clean half's token ids by name (the circuit's dataset checked
    to be pairs: `prepare_circuits`)."""
    inputs = batch.inputs
    if not isinstance(inputs, dict):
        raise TypeError(f"a pairs batch's inputs are a dict of token ids, not {type(inputs)}")
    return inputs


def _merged_scores(cp: CircuitPass, shard: Shard, state: Progress) -> dict[str, EdgeScores]:
    """Every rank's sums merged in rank order (every rank gets the same)."""
    states = gathered(shard, state.scores)
    merged = {}
    for m in cp.methods:
        total = states[0][m]
        for other in states[1:]:
            total = total.merge(other[m])
        merged[m] = total
    return merged


def finish_circuits(result: CircuitResult, run_dir: Path, h5_path: Path) -> None:
    """Rank 0: the tables, the figures, MIB's files (/circuit is in the file already)."""
    from probe.circuits.files import write_mib, write_tables
    from probe.report.circuits import write_figures

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


def reuse(sink: Sink, cp: CircuitPass) -> CircuitResult | None:
    """The result a finished circuit pass already wrote into the file with the same choices (a
    resumed run that had finished), else None."""
    f = sink.file
    if GROUP not in f:
        return None
    try:
        result = read_group(f[GROUP])
    except (DataError, KeyError):
        return None
    same = json.dumps(result.choices, sort_keys=True) == json.dumps(cp.choices(), sort_keys=True)
    return result if same and result.graph == cp.parts.graph else None
