"""The model-level planner: schedule, chunk count and partition from per-layer costs and a byte budget.

:func:`plan` tries every registry schedule that applies (and chunk counts for the interleaved one):
for each it takes the partition minimising the busiest rank's compute (the exact
:func:`~..partition.optimal_partition`), maps the layers onto per-stage costs in seconds and bytes,
builds the schedule under the memory left after each rank's static bytes, simulates it and refines the
cut points by the simulator (moves of one cut by one layer while the predicted period drops).  When
the fastest partition does not fit the budget, a memory-capped partition is tried (each stage's
activations weighted by the microbatches it held at once in the simulation).  The result names the
winner and keeps every alternative with its predicted time, bubble and peak bytes; when nothing fits,
a :class:`~..ir.ScheduleError` names the rank, the bytes it needs and the budget.  With
``head="both"`` every schedule is also tried with the output layer vocabulary-parallel.  On a grid
with replicas the winner's communication is then chosen by the lowering (:mod:`.choices`).

Pure Python; no torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from ..builders import REGISTRY, build_schedule, get_spec
from ..compare import OPTIMIZER_MODES, SLOW_SCHEDULES, iteration_period
from ..costs import CostModel
from ..ir import Kind, Schedule, ScheduleError
from ..lowering import CommChoice
from ..partition import MemoryCap, even_partition, optimal_partition
from ..sharding import FSDPOptions
from ..simulate import Timeline, simulate
from ..validate import validate_schedule
from .amounts import format_bytes, parse_bytes
from .choices import choose_comm
from .layout import Grid
from .profile import LayerProfile, ModelProfile, stage_costs
from .result import Plan, PlanCandidate, one_f_one_b_period


def plan(
    profile: ModelProfile,
    ranks: int,
    microbatches: int,
    memory_limit: str | float | None = None,
    schedules: Iterable[str] | None = None,
    interleaved_chunks: Sequence[int] = (2,),
    optimizer: str = "post-validation",
    device_memory: float | None = None,
    refine: int = 12,
    tie_margin: float = 0.05,
    cores: int | None = None,
    head: str = "plain",
    vocab_embedding: bool = False,
    layout: Grid | None = None,
    comm_candidates: Sequence[FSDPOptions] | None = None,
    defer_comm: bool = False,
) -> Plan:
    """Choose schedule, chunk count and partition for ``profile`` on ``ranks`` ranks (module docstring).

    ``memory_limit`` is a byte budget per rank (``"24GiB"``, a number, ``"80%"`` of
    ``device_memory``); ``schedules`` defaults to :func:`default_schedules`;
    ``interleaved_chunks`` are the chunk counts tried for interleaved 1F1B; ``optimizer`` selects the
    period minimised (``"post-validation"``: iteration time, ``"sync"``: makespan); ``refine`` bounds
    the simulator-guided moves of cut points of each candidate within 10 % of the best; a candidate
    with fewer chunks whose prediction is within ``tie_margin`` of the fastest wins the tie.
    ``cores`` fewer than ``ranks`` predicts ranks sharing that many processors (CPU ranks on one
    machine; the profile then holds each rank's times on a core of its own).  ``head`` is
    ``"plain"`` (the profile's last layer, the output layer, on the last stage), ``"vocab-parallel"``
    (that layer sharded over every rank by vocabulary, :mod:`~..vocab`) or ``"both"`` (the planner
    chooses; each candidate's ``vocab_parallel`` says which it is); ``vocab_embedding``: the
    profile's first layer is an embedding that is vocabulary-parallel along with the head (its
    bytes are then spread over the ranks and the partition covers the layers between).  ``layout``
    places each stage on ``dp × tp`` ranks (:class:`~..grid.Grid`: tensor-parallel costs,
    sharded bytes, the step's data-parallel collectives); the budget is then per rank of that mesh.
    With replicas the winner's communication is chosen (``Plan.comm``, :mod:`.choices`) here or, with
    ``defer_comm``, by the caller (:func:`with_comm`: ``plan --cluster`` prunes layouts first).
    Raises :class:`ScheduleError` naming the rank, its bytes and the budget when nothing fits.
    """
    layout = layout or Grid()
    budget = parse_bytes(memory_limit, device_memory)
    _check_request(profile, ranks, microbatches, optimizer, head, layout, budget)
    names = list(schedules) if schedules is not None else default_schedules(profile)
    common = _SearchArgs(profile, ranks, microbatches, budget, optimizer, refine, cores)
    searches = _searches(common, layout, head, vocab_embedding)
    ordered = _ordered(_candidates(searches, names, interleaved_chunks))
    if not (fitting := [c for c in ordered if c.fits]):
        raise ScheduleError(_nothing_fits(ordered, budget, ranks, layout))
    winner, known = _choose(fitting, tie_margin), profile.bytes_known
    reason = _reason(winner, ordered, budget, known) + _notes(searches, winner, layout, known, cores, ranks)
    planned = Plan(
        winner, ordered, ranks, microbatches, budget, optimizer, reason, cores=cores, bytes_known=known
    )
    if any(layer.all_to_all > 0 for layer in profile.layers):  # why, in terms of the expert all-to-all
        from .moe import moe_reason  # moe plans clusters through this module

        planned = replace(planned, reason=f"{planned.reason}; experts: {moe_reason(planned)}")
    if defer_comm or not known:
        return planned
    return with_comm(planned, _data_parallel(layout, searches[0].profile, winner, budget, comm_candidates))


def _notes(
    searches: Sequence[_Search],
    winner: PlanCandidate,
    layout: Grid,
    known: bool,
    cores: int | None,
    ranks: int,
) -> str:
    """The reason's notes after the choice: the busiest rank's memory on a mesh, shared cores, the
    measured head."""
    notes = "; " + searches[0].memory_text(winner) if not layout.trivial and known else ""
    if cores is not None and cores < ranks:
        notes += f"; {ranks} ranks predicted on {cores} shared cores"
    return notes + "".join("; " + s.head_text() for s in searches if isinstance(s, _VocabSearch))


def with_comm(planned: Plan, comm: CommChoice | None) -> Plan:
    """``planned`` with its replicas' communication chosen: ``comm``, and its reason appended (None,
    without replicas: ``planned``)."""
    if comm is None:
        return planned
    return replace(planned, comm=comm, reason=f"{planned.reason}; data parallel: {comm.reason}")


def _data_parallel(
    layout: Grid,
    profile: ModelProfile,
    winner: PlanCandidate,
    budget: float | None,
    candidates: Sequence[FSDPOptions] | None,
) -> CommChoice | None:
    """The replicas' communication for ``winner``, chosen by the lowering's simulator; None
    without replicas."""
    if layout.dp == 1:
        return None
    tried = list(candidates) if candidates is not None else None
    return choose_comm(layout, profile, winner, budget=budget, candidates=tried)


def default_schedules(profile: ModelProfile) -> list[str]:
    """Every registry schedule but the slow ones; with ``dualpipe-v`` when the profile has an expert
    all-to-all for its overlapped pairs to hide (:mod:`.moe`)."""
    moe = any(layer.all_to_all > 0 for layer in profile.layers)
    return [n for n in REGISTRY if n not in SLOW_SCHEDULES or (moe and n == "dualpipe-v")]


def _check_request(
    profile: ModelProfile,
    ranks: int,
    microbatches: int,
    optimizer: str,
    head: str,
    layout: Grid,
    budget: float | None,
) -> None:
    """Refuse what :func:`plan` cannot plan, before any candidate is built."""
    if optimizer not in OPTIMIZER_MODES:
        raise ScheduleError(
            f"unknown optimizer mode {optimizer!r}; choose one of {', '.join(OPTIMIZER_MODES)}"
        )
    if ranks < 1 or microbatches < 1:
        raise ScheduleError(f"ranks and microbatches must be at least 1, got {ranks} and {microbatches}")
    if head not in HEAD_LAYOUTS:
        raise ScheduleError(f"unknown head layout {head!r}; choose one of {', '.join(HEAD_LAYOUTS)}")
    if head != "plain" and not layout.trivial:
        raise ScheduleError(
            f"a vocabulary-parallel head is planned on pipeline ranks alone, not on {layout.describe()}"
        )
    if budget is not None and not profile.bytes_known:
        raise ScheduleError(
            f"the profile holds times but no bytes ({profile.source}), so a memory budget cannot be "
            "checked: plan without one, or from a profile with bytes ('zerobubble profile', or the trace of "
            "a run with --schedule auto or --partition profile)"
        )


class _SearchArgs(NamedTuple):
    """What every search of one :func:`plan` call shares: :class:`_Search`'s first arguments."""

    profile: ModelProfile
    ranks: int
    microbatches: int
    budget: float | None
    optimizer: str
    refine: int
    cores: int | None


def _searches(common: _SearchArgs, layout: Grid, head: str, vocab_embedding: bool) -> list[_Search]:
    """The searches ``head`` asks for: the output layer on the last stage, vocabulary-parallel, or both."""
    searches: list[_Search] = []
    if head != "vocab-parallel":
        searches.append(_Search(*common, layout))
    if head != "plain":
        searches.append(_VocabSearch(*common, embedding=vocab_embedding))
    return searches


def _ordered(candidates: Iterable[PlanCandidate]) -> tuple[PlanCandidate, ...]:
    """The candidates, those that fit first, then by predicted period (unknown last) and peak bytes."""
    return tuple(
        sorted(
            candidates,
            key=lambda c: (not c.fits, c.period is None, c.period or 0.0, max(c.peak_bytes or (0,))),
        )
    )


def _candidates(
    searches: Sequence[_Search], names: Sequence[str], interleaved_chunks: Sequence[int]
) -> list[PlanCandidate]:
    """Every search's candidate for every schedule (and chunk count), the promising ones refined.

    Refining costs simulations: only candidates within 10 % of the best fitting period are refined.
    """
    candidates: list[PlanCandidate] = []
    by_candidate: dict[int, _Search] = {}
    for search in searches:
        for name in names:
            spec = get_spec(name)
            for chunks in [spec.chunks] if spec.chunks is not None else list(interleaved_chunks):
                found = search.candidate(name, chunks)
                by_candidate[id(found)] = search
                candidates.append(found)
    periods = [c.period for c in candidates if c.fits and c.period is not None]
    threshold = min(periods) * 1.1 if periods else math.inf
    return [
        by_candidate[id(c)].refined(c)
        if c.period is not None and (c.period <= threshold or not periods)
        else c
        for c in candidates
    ]


def _choose(fitting: Sequence[PlanCandidate], tie_margin: float) -> PlanCandidate:
    """The fastest prediction, unless one with fewer chunks is within ``tie_margin`` of it.

    A schedule with ``v`` chunks runs ``v`` times the ops and about ``v`` times the transfers, and
    its balance rests on finer per-layer costs; the runtime's cost per op and per transfer is not in
    the model, so a prediction this close is a tie, and the simpler schedule wins it.  (Measured on
    the MLP of ``bench plan``: V schedules predicted 2.3–2.9 % ahead of single-chunk ones ran 0.5–6.5 %
    behind them; ``docs/auto-planning.md``.)
    """
    fastest = fitting[0]
    assert fastest.period is not None
    close = [c for c in fitting if c.period is not None and c.period <= fastest.period * (1 + tie_margin)]
    return min(close, key=lambda c: (c.chunks, c.period, max(c.peak_bytes)))


class _Search:
    """Builds and scores candidates for one profile, rank count and budget."""

    def __init__(
        self,
        profile: ModelProfile,
        ranks: int,
        microbatches: int,
        budget: float | None,
        optimizer: str,
        refine: int,
        cores: int | None = None,
        layout: Grid | None = None,
    ):
        self.layout = layout or Grid()
        # one rank's share of each layer's compute and activations (its static bytes: self.layout)
        self.profile = self.layout.per_rank(profile)
        self.ranks, self.microbatches = ranks, microbatches
        self.budget, self.optimizer, self.refine, self.cores = budget, optimizer, refine, cores
        self.work = [layer.work for layer in self.profile.layers]

    def candidate(self, name: str, chunks: int) -> PlanCandidate:
        """The better of the bottleneck-optimal and the even partition of ``name`` (or why there is none).

        When neither fits the budget, the partition optimal under the memory cap is tried as well.
        """
        stages = self.ranks * chunks
        if len(self.work) < stages:
            return PlanCandidate(
                name, chunks, note=f"needs at least {stages} layers, the model has {len(self.work)}"
            )
        try:
            placement = build_schedule(
                name, self.ranks, self.microbatches, chunks=chunks, validate=False
            ).placement
        except ScheduleError as error:
            return PlanCandidate(name, chunks, note=str(error))
        stage_ranks = placement.stage_ranks
        fastest = optimal_partition(self.work, stage_ranks)
        assert fastest is not None  # without a memory cap every partition is allowed
        even = tuple(even_partition(len(self.work), stages))
        options = [
            self._built(name, chunks, cuts, stage_ranks) for cuts in dict.fromkeys([fastest.cuts, even])
        ]
        best = min(options, key=_rank_key)
        if not best.fits and best.timeline is not None and self.budget is not None:
            capped = optimal_partition(self.work, stage_ranks, self._memory_cap(best))
            if capped is not None and capped.cuts not in (fastest.cuts, even):
                best = min([best, self._built(name, chunks, capped.cuts, stage_ranks)], key=_rank_key)
        return best

    def refined(self, candidate: PlanCandidate) -> PlanCandidate:
        """Move one cut by one layer while that shortens the simulated period (at most ``refine`` moves).

        The moves keep the candidate's op order and only re-simulate it (milliseconds); the final
        partition is then built afresh and the better of the two kept.
        """
        order = candidate.built
        if order is None or candidate.period is None:
            return candidate
        count, stage_ranks = len(self.work), order.placement.stage_ranks
        best, seen = candidate, {candidate.partition}
        for _ in range(self.refine):
            neighbours = []
            for index, cut in enumerate(best.partition):
                for step in (-1, 1):
                    cuts = list(best.partition)
                    cuts[index] = cut + step
                    if (
                        all(a < b for a, b in itertools.pairwise([0, *cuts, count]))
                        and tuple(cuts) not in seen
                    ):
                        neighbours.append(tuple(cuts))
            seen.update(neighbours)
            improved = min([best, *(self._simulated(order, cuts) for cuts in neighbours)], key=_rank_key)
            if improved is best:
                break
            best = improved
        if best is candidate:
            return candidate
        rebuilt = self._built(candidate.schedule, candidate.chunks, best.partition, stage_ranks)
        return min([best, rebuilt], key=_rank_key)

    def _built(
        self, name: str, chunks: int, cuts: tuple[int, ...], stage_ranks: Sequence[int]
    ) -> PlanCandidate:
        """Build ``name`` for the cut points ``cuts`` under the budget left after static bytes; score it."""
        static = self._static_bytes(cuts, stage_ranks)
        limits = None
        if self.budget is not None:
            limits = [self.budget - s for s in static]
            worst = max(range(self.ranks), key=lambda r: static[r])
            if limits[worst] <= 0:
                note = (
                    f"rank {worst} holds {format_bytes(static[worst])} of parameters, gradients and "
                    "optimizer state alone"
                )
                return PlanCandidate(name, chunks, cuts, peak_bytes=tuple(static), note=note)
        try:
            costs = stage_costs(self.profile, cuts, len(stage_ranks), limits)
            schedule = self._build(name, costs, chunks)
            # the budget is checked on static + activation bytes: validate without the limit
            validate_schedule(schedule, self._score_costs(costs).with_memory_limit(None))
        except ScheduleError as error:
            return self._tag(PlanCandidate(name, chunks, cuts, peak_bytes=tuple(static), note=str(error)))
        return self._simulated(schedule, cuts)

    def _build(self, name: str, costs: CostModel, chunks: int) -> Schedule:
        return build_schedule(name, self.ranks, self.microbatches, costs, chunks=chunks, validate=False)

    def _score_costs(self, costs: CostModel) -> CostModel:
        return costs

    def _tag(self, candidate: PlanCandidate) -> PlanCandidate:
        return candidate

    def _simulated(self, schedule: Schedule, cuts: tuple[int, ...]) -> PlanCandidate:
        """Score a valid ``schedule`` with the layers cut at ``cuts``."""
        stage_ranks = schedule.placement.stage_ranks
        static = self._static_bytes(cuts, stage_ranks)
        # a schedule of BW ops is predicted with the measured fused backward
        costs = stage_costs(self.profile, cuts, len(stage_ranks), fused=not schedule.splits_backward)
        costs = self._score_costs(costs)
        timeline = simulate(schedule, costs, cores=self.cores)
        # the step's data-parallel collectives, exposed in full (.layout), on the slowest rank
        collectives = max(
            self.layout.step_seconds(layers, schedule.chunks, self.microbatches)
            for layers in self._rank_layers(cuts, stage_ranks)
        )
        peaks = tuple(s + a for s, a in zip(static, timeline.peak_memory))
        fits = self.budget is None or all(peak <= self.budget * (1 + 1e-9) for peak in peaks)
        over = max(range(self.ranks), key=lambda r: peaks[r])
        sync = self.optimizer == "sync"
        return self._tag(
            PlanCandidate(
                schedule.name,
                schedule.chunks,
                cuts,
                period=iteration_period(timeline, self.optimizer) + collectives,
                iteration_time=timeline.iteration_time + collectives,
                makespan=timeline.makespan + collectives,
                bubble_rate=timeline.bubble_rate_makespan if sync else timeline.bubble_rate,
                peak_bytes=peaks,
                fits=fits,
                note="" if fits else f"rank {over} needs {format_bytes(peaks[over])}",
                built=schedule,
                costs=costs,
                timeline=timeline,
            )
        )

    def _static_bytes(self, cuts: Sequence[int], stage_ranks: Sequence[int]) -> list[float]:
        return [self.layout.held_bytes(layers) for layers in self._rank_layers(cuts, stage_ranks)]

    def _rank_layers(self, cuts: Sequence[int], stage_ranks: Sequence[int]) -> list[list[LayerProfile]]:
        """The layers each rank holds with the layers cut at ``cuts``."""
        bounds = [0, *cuts, len(self.work)]
        held: list[list[LayerProfile]] = [[] for _ in range(self.ranks)]
        for stage, rank in enumerate(stage_ranks):
            held[rank].extend(self.profile.layers[bounds[stage] : bounds[stage + 1]])
        return held

    def memory_text(self, winner: PlanCandidate) -> str:
        """Where the winner's busiest rank's bytes go (:meth:`..grid.Grid.memory_text`)."""
        assert winner.built is not None
        busiest = max(range(self.ranks), key=lambda r: winner.peak_bytes[r])
        layers = self._rank_layers(winner.partition, winner.built.placement.stage_ranks)[busiest]
        return self.layout.memory_text(layers, winner.peak_bytes[busiest])

    def _memory_cap(self, candidate: PlanCandidate) -> MemoryCap:
        """The budget as a partition constraint: each stage's activations times its peak in-flight count."""
        assert candidate.timeline is not None and self.budget is not None
        return MemoryCap(
            fixed=[self.layout.static_bytes(layer) for layer in self.profile.layers],
            scaled=[layer.activation_bytes for layer in self.profile.layers],
            inflight=_peak_inflight(candidate.timeline),
            capacity=[self.budget] * self.ranks,
        )


#: The output-layer layouts :func:`plan` takes.
HEAD_LAYOUTS = ("plain", "vocab-parallel", "both")


class _VocabSearch(_Search):
    """Candidates with the profile's last layer (the output layer) vocabulary-parallel: the other
    layers are cut over the stages, and every rank holds ``1/p`` of the output layer, whose S pass
    costs its share of the measured forward and input gradient, T its share of the weight gradient
    (the same matmuls, cut by vocabulary rows), S keeping its share of the layer's activations."""

    def __init__(self, profile: ModelProfile, ranks: int, *args: Any, embedding: bool = False):
        first = 1 if embedding else 0
        if len(profile.layers) < 2 + first:
            raise ScheduleError("a vocabulary-parallel head needs a profile of at least two layers")
        head = profile.layers[-1]
        super().__init__(replace(profile, layers=profile.layers[first:-1]), ranks, *args)
        self.head = head
        spread = [head, *profile.layers[:first]]  # the head's and the embedding's rows on every rank
        self.head_static = math.fsum(layer.static_bytes for layer in spread) / ranks

    def _head_costs(self, costs: CostModel) -> CostModel:
        head, p = self.head, self.ranks
        return costs.replace(
            vocab_s=(head.forward + head.backward_input) / p,
            vocab_t=head.backward_weight / p,
            vocab_mem=head.activation_bytes / p,
            # the hidden states broadcast, the gradient parts (twice their width) gathered
            vocab_comm=self.profile.transfer_time(3 * self.profile.layers[-1].output_bytes),
        )

    def head_text(self) -> str:
        """Where the vocabulary ops' costs come from: the profile's measured output layer."""
        head, p, blocks = self.head, self.ranks, self.profile.layers
        share = head.work / (math.fsum(layer.work for layer in blocks) / len(blocks))
        f_b, w = head.forward + head.backward_input, head.backward_weight
        return (
            f"head measured: F+B {f_b * 1e3:.3f} ms, W {w * 1e3:.3f} ms ({share:.2f}x a mean layer's "
            f"work), so S {f_b / p * 1e3:.3f} ms and T {w / p * 1e3:.3f} ms per shard of {p}"
        )

    def _build(self, name: str, costs: CostModel, chunks: int) -> Schedule:
        return build_schedule(
            name, self.ranks, self.microbatches, self._head_costs(costs), chunks=chunks, validate=False,
            vocab_parallel=True,
        )  # fmt: skip

    def _score_costs(self, costs: CostModel) -> CostModel:
        return self._head_costs(costs)

    def _static_bytes(self, cuts: Sequence[int], stage_ranks: Sequence[int]) -> list[float]:
        return [s + self.head_static for s in super()._static_bytes(cuts, stage_ranks)]

    def _tag(self, candidate: PlanCandidate) -> PlanCandidate:
        return replace(candidate, vocab_parallel=True)


def _rank_key(candidate: PlanCandidate) -> tuple[bool, float, float]:
    return (
        not candidate.fits,
        candidate.period if candidate.period is not None else math.inf,
        max(candidate.peak_bytes or (0.0,)),
    )


def _peak_inflight(timeline: Timeline) -> list[float]:
    """Per stage, the most microbatches whose forward ran and whose activations are not yet freed."""
    schedule = timeline.schedule
    peaks = [0.0] * schedule.num_stages
    for program in schedule.programs:
        held = [0] * schedule.num_stages
        for op in program:
            if op.kind is Kind.F:
                held[op.stage] += 1
                peaks[op.stage] = max(peaks[op.stage], held[op.stage])
            elif op.kind in (Kind.B, Kind.BW):
                held[op.stage] -= 1
    return peaks


def _reason(
    winner: PlanCandidate, candidates: Sequence[PlanCandidate], budget: float | None, bytes_known: bool
) -> str:
    reference = one_f_one_b_period(candidates)
    fastest = next(c for c in candidates if c.fits)
    runner_up = next((c for c in candidates if c.fits and c is not winner), None)
    assert winner.period is not None and fastest.period is not None
    if fastest is winner:
        parts = [
            f"{winner.label} (v={winner.chunks}) with partition {list(winner.partition)} has the shortest "
            f"predicted period among the schedules that fit, {winner.period * 1e3:.3f} ms"
        ]
        if runner_up is not None and runner_up.period:
            parts.append(f"{runner_up.period / winner.period - 1:.1%} ahead of {runner_up.label}")
        other = next((c for c in candidates if c.fits and c.vocab_parallel != winner.vocab_parallel), None)
        if other is not None and other.period:
            layout = "vocabulary-parallel" if other.vocab_parallel else "plain"
            parts.append(
                f"{other.period / winner.period - 1:.1%} ahead of the best {layout} head ({other.label})"
            )
    else:
        parts = [
            f"{winner.label} (v={winner.chunks}) with partition {list(winner.partition)}, predicted "
            f"{winner.period * 1e3:.3f} ms, is within {winner.period / fastest.period - 1:.1%} of the "
            f"fastest prediction ({fastest.label}, v={fastest.chunks}) with fewer chunks: fewer ops and "
            "transfers, whose overhead the model leaves out"
        ]
    if reference:
        parts.append(f"{reference / winner.period:.3f}x 1f1b")
    if not bytes_known:
        parts.append("peak memory not recorded (the profile holds times only)")
        return "; ".join(parts)
    peak = max(winner.peak_bytes)
    parts.append(
        f"peak {format_bytes(peak)} per rank"
        + (f" within the budget {format_bytes(budget)}" if budget else "")
    )
    return "; ".join(parts)


def _nothing_fits(candidates: Sequence[PlanCandidate], budget: float | None, ranks: int, layout: Grid) -> str:
    # a candidate that was simulated needs its peak; one that was not built, its static bytes when
    # they alone exceed the budget (otherwise its note says why it was not built)
    measured = [
        c
        for c in candidates
        if c.peak_bytes and (c.timeline is not None or (budget is not None and max(c.peak_bytes) > budget))
    ]
    if not measured or budget is None:
        notes = "; ".join(f"{c.schedule}: {c.note}" for c in candidates)
        return f"no schedule can run on {ranks} ranks: {notes}"
    smallest = min(measured, key=lambda c: max(c.peak_bytes))
    rank = max(range(len(smallest.peak_bytes)), key=lambda r: smallest.peak_bytes[r])
    need = smallest.peak_bytes[rank]
    where = "" if layout.trivial else f" (each stage on {layout.describe()})"
    return (
        f"no schedule fits the memory budget of {format_bytes(budget)} per rank{where}: the smallest need is "
        f"{smallest.schedule} (v={smallest.chunks}, partition {list(smallest.partition)}), whose rank {rank} "
        f"needs {format_bytes(need)} ({need:.0f} bytes) against the budget of {budget:.0f} bytes; raise the "
        "budget, use more ranks or smaller microbatches"
    )
