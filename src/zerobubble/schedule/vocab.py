"""Vocabulary parallelism in the schedule: the output layer's S and T passes placed into any schedule.

With a vocabulary-parallel output layer (arXiv 2411.05288) every rank holds ``1/p`` of the vocabulary
and runs, for each microbatch ``j``, an ``S`` pass (its slice's logits, its share of the loss and of
the last stage's input gradient, after the last stage's hidden states are broadcast) and a ``T`` pass
(its slice's weight gradient).  All communication of a microbatch is started at the end of its S
passes (the *one-barrier* form): the last stage's backward and every T wait for it, and nothing else
does, so the ranks go on with other work while it travels.

:func:`add_vocab_ops` takes a schedule built by any builder and interleaves the S and T ops with its
own ops by list scheduling (S as soon as its input is there, T where a rank would idle or where the
logits it frees must go), trying a few policies and keeping the fastest that respects the memory
limit.  The base schedule's own order is kept.  :func:`head_costs` gives the costs of the output
layer, plain or vocabulary-parallel, from its sizes (``docs/schedulers.md``, "Vocabulary parallelism").
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .costs import CostModel, StageCosts, within_limit
from .ir import Kind, Op, Schedule, ScheduleError
from .simulate import Timeline, resolve_costs_for, simulate, timed_dependencies

_PRODUCES = {Kind.F: (Kind.F,), Kind.B: (Kind.B,), Kind.W: (Kind.W,), Kind.BW: (Kind.B, Kind.W)}


@dataclass(frozen=True)
class VocabPolicy:
    """How :func:`add_vocab_ops` places the vocabulary ops: at most ``outstanding`` microbatches
    between a rank's S and its T (the logits a rank holds); ``eager`` T before the rank's own next
    op (else T runs only where the rank would idle, or when the bound forces it); and ``lookahead``
    forwards a rank may run ahead of its program while its next op waits (the last stage's backward
    waits for the reduction: one more forward in flight hides it, as a deeper warm-up would); and
    ``patience``: a rank whose S input arrives within that fraction of its next op's duration waits
    for it instead of starting the op (every shard's S is on the last stage's critical path); and
    ``deeper``: every rank's forwards moved that many backwards earlier in its program (a warm-up
    that many microbatches deeper, as the paper's vocabulary-parallel schedules have: the last
    stage's backward then waits for the reduction behind a forward, not in idle time); and
    ``by_memory``: a rank may hold more than ``outstanding`` while its memory limit allows it (the
    S's logits plus the most its own ops will still hold stay within the limit), so T fills the
    cool-down's idle time instead of the steady state's (only bounds with a finite limit)."""

    outstanding: int
    eager: bool
    lookahead: int = 0
    patience: float = 0.0
    deeper: int = 0
    by_memory: bool = False

    def describe(self) -> str:
        """The policy in words, for ``meta["vocab"]``."""
        ahead = f", {self.lookahead} forward(s) ahead" if self.lookahead else ""
        wait = f", waits up to {self.patience:g}× an op for its S" if self.patience else ""
        deeper = f", warm-up {self.deeper} deeper" if self.deeper else ""
        placing = "eager" if self.eager else "idle-filling"
        more = " (more where memory allows)" if self.by_memory else ""
        return f"{placing} T, at most {self.outstanding} outstanding{more}{deeper}{ahead}{wait}"


#: How many of a rank's next program entries :class:`VocabPolicy.lookahead` looks through for a forward.
LOOKAHEAD_WINDOW = 4


def default_policies(microbatches: int) -> tuple[VocabPolicy, ...]:
    """The T placements :func:`add_vocab_ops` tries first: bounds 1, 2, 4 and ``m``, eager or
    idle-filling T, on the schedule's own warm-up and on one a microbatch deeper, with neither
    lookahead nor patience."""
    bounds = sorted({min(b, microbatches) for b in (1, 2, 4, microbatches)})
    return tuple(
        VocabPolicy(bound, eager, deeper=deeper, by_memory=by_memory)
        for deeper in (0, 1)
        for bound in bounds
        for eager, by_memory in ((False, False), (True, False), (False, True))
        if not by_memory or bound == 1
    )


def refined_policies(policy: VocabPolicy) -> tuple[VocabPolicy, ...]:
    """``policy``'s T placement and warm-up with zero to two forwards ahead and patience 0, ½ or 1
    (also ¾ for a ``by_memory`` policy; the second round of :func:`add_vocab_ops`)"""
    return tuple(
        VocabPolicy(policy.outstanding, policy.eager, ahead, patience, policy.deeper, policy.by_memory)
        for ahead in (0, 1, 2)
        for patience in ((0.0, 0.5, 0.75, 1.0) if policy.by_memory else (0.0, 0.5, 1.0))
        if ahead or patience
    )


def add_vocab_ops(
    schedule: Schedule,
    costs: CostModel | StageCosts | None = None,
    *,
    policies: tuple[VocabPolicy, ...] | None = None,
) -> Schedule:
    """``schedule`` with every shard's S and T op of every microbatch placed into its programs.

    Each policy of ``policies`` gives one candidate; by default those of :func:`default_policies`,
    then :func:`refined_policies` around the best of each warm-up depth.  Among those whose activation memory
    respects ``costs.memory_limit``, the fastest is returned, or the one of lowest largest-rank peak
    among those within :data:`TIME_TOLERANCE` of the fastest (a placement that holds more buys
    nothing).  With no candidate within the limit, the least hungry is returned (the validator
    then says by how much).  A deeper warm-up that would deadlock this schedule is skipped.
    ``meta["vocab"]`` records the policy.  Raises :class:`ScheduleError` for a schedule that already
    has S or T ops.
    """
    if schedule.vocab_shards:
        raise ScheduleError(f"schedule {schedule.name!r} already has vocabulary ops (S, T)")
    scored = _placements(schedule, resolve_costs_for(schedule, costs), policies)
    if not scored:
        raise ScheduleError(
            f"none of the vocabulary policies {[p.describe() for p in policies or ()]} can place the "
            f"S and T ops into schedule {schedule.name!r} (each deeper warm-up deadlocks it)"
        )
    return _chosen(scored, bool(_cramped(scored)))


def _placements(
    schedule: Schedule, stage_costs: StageCosts, policies: tuple[VocabPolicy, ...] | None
) -> list[tuple[Timeline, Schedule, VocabPolicy]]:
    """Every candidate placement of :func:`add_vocab_ops`, simulated, with its policy."""
    rounds = [policies] if policies else [default_policies(schedule.microbatches), None]
    if all(math.isinf(limit) for limit in stage_costs.memory_limit):  # by_memory is the bound alone
        rounds = [tuple(p for p in tried if not p.by_memory) if tried else tried for tried in rounds]
    if schedule.overlapped:  # a deeper warm-up would move a pair's forward away from its backward
        rounds = [tuple(p for p in tried if not p.deeper) if tried else tried for tried in rounds]
    scored: list[tuple[Timeline, Schedule, VocabPolicy]] = []
    for tried in rounds:
        if tried is None:  # refine around the best of each warm-up depth, and the memory-bound ones
            depths = sorted({policy.deeper for _, _, policy in scored})
            leaders = [_choose([e for e in scored if e[2].deeper == d])[2] for d in depths]
            leaders += [e[2] for e in scored if e[2].by_memory and e[2] not in leaders]
            tried = tuple(q for policy in leaders for q in refined_policies(policy))
        for policy in tried:
            try:
                candidate = _interleave(schedule, stage_costs, policy)
            except ScheduleError:
                if not policy.deeper:
                    raise
                continue  # this schedule's order cannot take a deeper warm-up
            scored.append((simulate(candidate, stage_costs), candidate, policy))
    return scored


#: How many of the deeper warm-ups that do not fit :func:`place_vocab_ops` retries on a smaller base.
CRAMPED_RETRIES = 4


def _cramped(scored: Sequence[tuple[Timeline, Schedule, VocabPolicy]]) -> tuple[VocabPolicy, ...]:
    """The deeper warm-ups 1 % faster than the chosen placement that do not fit its memory limit,
    fastest first (at most :data:`CRAMPED_RETRIES`)."""
    best = _choose(scored)[0]
    faster = sorted(
        (timeline.iteration_time, i)
        for i, (timeline, _, policy) in enumerate(scored)
        if policy.deeper and not _within(timeline) and timeline.iteration_time < best.iteration_time * 0.99
    )
    return tuple(scored[i][2] for _, i in faster[:CRAMPED_RETRIES])


def _chosen(scored: Sequence[tuple[Timeline, Schedule, VocabPolicy]], cramped: bool) -> Schedule:
    placed = _choose(scored)[1]
    meta = {**placed.meta, "vocab": {**placed.meta["vocab"], "cramped": cramped}}
    return Schedule(
        placed.name, placed.placement, placed.microbatches, placed.programs, meta, placed.overlapped
    )


def place_vocab_ops(build: Callable[[CostModel], Schedule], base: CostModel, final: CostModel) -> Schedule:
    """The schedule ``build(base)`` with its vocabulary ops placed under ``final`` (what
    ``build_schedule(..., vocab_parallel=True)`` runs).  When a deeper warm-up would be faster but
    does not fit ``base``'s memory limit (:func:`_cramped`), the schedule is also built under that
    limit less one and two microbatches of the largest stage's activations, those warm-ups are placed
    into it, and the fastest placement within ``final``'s limit is kept
    (``meta["vocab"]["base_held_less"]`` says by how much that base's limit was lowered): a base that
    holds a little less leaves room for the deeper warm-up that hides the reduction
    (``docs/schedulers.md``, "Vocabulary parallelism").
    """
    built = build(base)
    scored = _placements(built, resolve_costs_for(built, final), None)
    cramped = _cramped(scored)
    placed, name = _chosen(scored, bool(cramped)), built.name
    if base.memory_limit is None or not cramped:
        return placed
    stage_costs = resolve_costs_for(placed, final)
    best = (simulate(placed, stage_costs), placed)
    unit = max(stage_costs.mem_b)
    limits = _per_rank(base.memory_limit, placed.num_ranks)
    for held_less in (1, 2):
        reduced = tuple(limit - held_less * unit for limit in limits)
        if min(reduced) <= 0:
            break
        try:
            candidate = add_vocab_ops(build(base.with_memory_limit(reduced)), final, policies=cramped)
        except ScheduleError:
            continue  # the builder cannot fit its schedule in so little memory
        timeline = simulate(candidate, stage_costs)
        if _within(timeline) and timeline.iteration_time < best[0].iteration_time:
            vocab = {**candidate.meta["vocab"], "base_held_less": held_less * unit}
            meta = {**candidate.meta, "vocab": vocab}
            best = (
                timeline,
                Schedule(
                    name,
                    candidate.placement,
                    candidate.microbatches,
                    candidate.programs,
                    meta,
                    candidate.overlapped,
                ),
            )
    return best[1]


def _choose(
    scored: Sequence[tuple[Timeline, Schedule, VocabPolicy]],
) -> tuple[Timeline, Schedule, VocabPolicy]:
    """The fastest within the memory limit, the least hungry of those within
    :data:`TIME_TOLERANCE` of it (else the least hungry of all)."""
    fitting = [entry for entry in scored if _within(entry[0])]
    if not fitting:
        return min(scored, key=lambda entry: max(entry[0].peak_memory))
    costs = fitting[0][0].costs
    if all(math.isinf(limit) for limit in costs.memory_limit):  # no limit: keep the ranks' memory even
        ceiling = min(max(e[0].peak_memory) for e in fitting) * MEMORY_SLACK + max(costs.mem_b) + 1e-12
        fitting = [entry for entry in fitting if max(entry[0].peak_memory) <= ceiling]
    fastest = min(entry[0].iteration_time for entry in fitting)
    close = [entry for entry in fitting if entry[0].iteration_time <= fastest * (1 + TIME_TOLERANCE)]
    return min(close, key=lambda entry: (max(entry[0].peak_memory), entry[0].iteration_time))


#: Without a memory limit, how far above the lowest largest-rank peak (plus one microbatch of the
#: largest stage's activations, the deeper warm-up's price) :func:`add_vocab_ops` may go for speed.
MEMORY_SLACK = 1.15

#: How much slower than the fastest fitting candidate :func:`add_vocab_ops` may pick to hold less.
TIME_TOLERANCE = 0.002


#: The microbatches of vocabulary memory (``vocab_mem``) a memory budget sets aside per rank.
RESERVED_MICROBATCHES = 2


def vocab_budgets(costs: CostModel, num_ranks: int, *, budget_given: bool) -> tuple[CostModel, CostModel]:
    """The costs to build the base schedule under, and those the vocabulary-parallel schedule must
    respect.  A user's ``memory_limit`` (``budget_given``) is the whole budget: the base schedule
    gets it less :data:`RESERVED_MICROBATCHES` microbatches of ``vocab_mem``.  A limit the schedule
    defines itself (zb-1p's p·M_B) bounds the pipeline's own activations; the reserve comes on top.
    """
    if costs.memory_limit is None:
        return costs, costs
    limits, vocab_mem = _per_rank(costs.memory_limit, num_ranks), _per_rank(costs.vocab_mem, num_ranks)
    reserve = tuple(RESERVED_MICROBATCHES * mem for mem in vocab_mem)
    if not budget_given:
        return costs, costs.with_memory_limit(tuple(limit + r for limit, r in zip(limits, reserve)))
    left = tuple(limit - r for limit, r in zip(limits, reserve))
    if min(left) <= 0:
        rank = left.index(min(left))
        raise ScheduleError(
            f"the memory limit {limits[rank]:g} of rank {rank} leaves nothing for the pipeline once the "
            f"vocabulary-parallel output layer's {RESERVED_MICROBATCHES} microbatches "
            f"({reserve[rank]:g}) are set aside; raise the limit"
        )
    return costs.with_memory_limit(left), costs


def _per_rank(value: float | Sequence[float], num_ranks: int) -> tuple[float, ...]:
    return tuple(float(v) for v in value) if isinstance(value, Sequence) else (float(value),) * num_ranks


def _within(timeline: Timeline) -> bool:
    limits = timeline.costs.memory_limit
    return all(within_limit(peak, limit) for peak, limit in zip(timeline.peak_memory, limits))


class _Interleaving:
    """One list-scheduling pass: the ranks advance in time order; a free rank runs the first of
    its next S, its next own op and its next T (in the policy's priority) whose inputs are there."""

    def __init__(self, schedule: Schedule, costs: StageCosts, policy: VocabPolicy):
        self.schedule, self.costs, self.policy = schedule, costs, policy
        # an overlapped pair is placed as one unit, named by its forward: its halves stay adjacent
        self.partner = dict(schedule.overlapped)
        self.paired = {op for pair in schedule.overlapped for op in pair}
        p = schedule.num_ranks
        self.rank_of = schedule.placement.stage_ranks
        self.queues = [deque(program) for program in schedule.programs]
        self.next_s, self.next_t, self.early = [0] * p, [0] * p, [0] * p
        self.done: dict[tuple[Kind, int, int], float] = {}
        self.programs: list[list[Op]] = [[] for _ in range(p)]
        self.level = [0.0] * p  # each rank's activation memory now, the vocabulary's included

    def duration(self, op: Op) -> float:
        """How long ``op`` runs: an overlapped pair's forward stands for the whole pair."""
        backward = self.partner.get(op)
        return self.costs.duration(op) if backward is None else self.costs.pair_duration(op, backward)

    def delta(self, op: Op) -> float:
        """The memory ``op`` (or the pair it starts) takes (negative: frees)."""
        backward = self.partner.get(op)
        change = self.costs.memory_delta(op)
        return change if backward is None else change + self.costs.memory_delta(backward)

    def fits(self, rank: int, op: Op) -> bool:
        """Whether ``op`` on ``rank`` keeps its memory within the limit (always, but ``by_memory``)."""
        if not self.policy.by_memory:
            return True
        return within_limit(self.level[rank] + self.delta(op), self.costs.memory_limit[rank])

    def candidates(self, rank: int, now: float) -> list[Op]:
        """The ops ``rank`` may run next, highest priority first.  Past ``outstanding`` held S's
        (``by_memory``: and past the memory limit), T runs first; ``by_memory`` holds an S more,
        and runs an own op, only where the memory limit allows it."""
        m, policy = self.schedule.microbatches, self.policy
        s, t = self.next_s[rank], self.next_t[rank]
        vocab_s = Op(Kind.S, rank, s)
        holdable = s - t < policy.outstanding or (policy.by_memory and self.fits(rank, vocab_s))
        vocab_ss = [vocab_s] if s < m and holdable else []
        vocab_t = [Op(Kind.T, rank, t)] if t < s else []
        queue = self.queues[rank]
        own = [queue[0]] if queue else []
        if self.early[rank] < policy.lookahead:
            window = itertools.islice(queue, 1, 1 + LOOKAHEAD_WINDOW)
            ahead = (op for op in window if op.kind is Kind.F and op not in self.paired)
            own += [next(ahead, own[0])] if own else []
        crowded = [op for op in own if not self.fits(rank, op)]
        forced = bool(vocab_t) and (bool(crowded) or (not holdable and self.s_due(rank, now, own)))
        own = [op for op in own if op not in crowded] if vocab_t else own
        return vocab_ss + (vocab_t + own if policy.eager or forced else own + vocab_t)

    def s_due(self, rank: int, now: float, own: list[Op]) -> bool:
        """Whether ``rank``'s next S (held back by the bound) gets its input before the rank's next
        own op would end: its T then runs first, so the S is not delayed behind that op.  Without
        ``by_memory``, T runs first whenever the bound holds S back."""
        if not self.policy.by_memory or not own or self.next_s[rank] >= self.schedule.microbatches:
            return True
        return self.ready_time(Op(Kind.S, rank, self.next_s[rank])) <= now + self.duration(own[0])

    def ready_time(self, op: Op) -> float:
        """When ``op``'s inputs are all there (inf while one of them is not placed yet); a pair's
        forward: when both halves' are."""
        backward = self.partner.get(op)
        if backward is not None:
            return max(self._ready(op), self._ready(backward))
        return self._ready(op)

    def _ready(self, op: Op) -> float:
        ready = 0.0
        S, shards = self.schedule.num_stages, self.schedule.num_ranks
        for role, stage, j, delay in timed_dependencies(op, S, self.rank_of, self.costs, shards):
            finished = self.done.get((role, stage, j))
            if finished is None:
                return math.inf
            ready = max(ready, finished + delay)
        return ready

    def run(self, rank: int, op: Op, start: float) -> float:
        """Place ``op`` (with its pair's backward) on ``rank`` at ``start``; its end."""
        end = start + self.duration(op)
        backward = self.partner.get(op)
        if backward is not None:  # both halves end together, side by side in the program
            for role in _PRODUCES[backward.kind]:
                self.done[(role, backward.stage, backward.microbatch)] = end
            self.queues[rank].remove(backward)
            self.level[rank] += self.costs.memory_delta(backward)
        for role in _PRODUCES.get(op.kind, (op.kind,)):
            self.done[(role, op.stage, op.microbatch)] = end
        self.programs[rank].append(op)
        if backward is not None:
            self.programs[rank].append(backward)
        if op.kind is Kind.S:
            self.next_s[rank] += 1
        elif op.kind is Kind.T:
            self.next_t[rank] += 1
        elif self.queues[rank][0] == op:
            self.queues[rank].popleft()
        else:  # a forward run ahead of its place
            self.queues[rank].remove(op)
            self.early[rank] += 1
        self.level[rank] += self.costs.memory_delta(op)
        return end


def deepened(schedule: Schedule, deeper: int) -> Schedule:
    """``schedule`` with every rank's forwards ``deeper`` backwards (B or BW) earlier in its program:
    each forward that followed the rank's ``n``-th backward now precedes its ``n - deeper``-th.  The
    order of the forwards and of the other ops is kept; the activations of ``deeper`` more
    microbatches are held at once."""
    if deeper <= 0:
        return schedule
    programs = []
    for program in schedule.programs:
        others = [op for op in program if op.kind is not Kind.F]
        backwards = [i for i, op in enumerate(others) if op.kind in (Kind.B, Kind.BW)]
        before: list[list[Op]] = [[] for _ in range(len(others) + 1)]  # forwards before others[i]
        seen = backwards_seen = 0
        for op in program:
            if op.kind is Kind.F:
                target = backwards_seen - deeper
                before[min(seen, backwards[target]) if target >= 0 else 0].append(op)
            else:
                seen += 1
                backwards_seen += op.kind in (Kind.B, Kind.BW)
        programs.append([*itertools.chain.from_iterable([*before[i], op] for i, op in enumerate(others))])
        programs[-1].extend(before[-1])
    return Schedule(schedule.name, schedule.placement, schedule.microbatches, programs, schedule.meta)


def _interleave(schedule: Schedule, costs: StageCosts, policy: VocabPolicy) -> Schedule:
    state = _Interleaving(deepened(schedule, policy.deeper), costs, policy)
    p = schedule.num_ranks
    heap = [(0.0, rank, rank) for rank in range(p)]  # (time the rank decides, tie order, rank)
    order, stalled, stalled_at = p, 0, -1.0
    deferred: set[tuple[int, float]] = set()
    while heap:
        now, _, rank = heapq.heappop(heap)
        options = state.candidates(rank, now)
        if not options:
            continue  # this rank is done
        ready = [state.ready_time(op) for op in options]
        chosen = next((op for op, at in zip(options, ready) if at <= now), None)
        if chosen is not None and policy.patience and options[0].kind is Kind.S and chosen is not options[0]:
            if ready[0] == math.inf and (rank, now) not in deferred and any(e[0] == now for e in heap):
                deferred.add((rank, now))  # a peer deciding at this instant may start the hidden states
                order += 1
                heapq.heappush(heap, (now, order, rank))
                continue
            if ready[0] - now <= policy.patience * state.duration(chosen):
                chosen = None  # wait for the S input rather than delay every shard's reduction
        if chosen is not None:
            stalled, order = 0, order + 1
            heapq.heappush(heap, (state.run(rank, chosen, now), order, rank))
            continue
        later = [at for at in ready if now < at < math.inf] + [entry[0] for entry in heap if entry[0] > now]
        stalled = stalled + 1 if stalled_at == now else 1
        stalled_at = now
        if not later and stalled > 4 * p:  # every rank waits at this instant for what none will do
            raise ScheduleError(
                f"cannot place the vocabulary ops into schedule {schedule.name!r}: rank {rank} waits "
                f"for the inputs of {options[0]} forever (the schedule deadlocks; validate it first)"
            )
        order += 1
        heapq.heappush(heap, (min(later) if later else now, order, rank))
    meta = {**schedule.meta, "vocab": {"barriers": 1, "policy": policy.describe()}}
    return Schedule(
        schedule.name, schedule.placement, schedule.microbatches, state.programs, meta, schedule.overlapped
    )


def partition_reference(
    name: str, stages: int, microbatches: int, costs: CostModel, *, chunks: int | None = None
) -> float:
    """The iteration time of schedule ``name`` with the vocabulary-parallel head perfectly partitioned:
    each rank's shard folded into its own stages (S split evenly over its forwards and input
    gradients, T added to its weight gradients), with no vocabulary op, collective or memory.

    The *partition bound* of issue 47, as a reference rather than a lower bound: folding puts each
    rank's share of S on the pipeline's dependency chain once per stage, where the
    vocabulary-parallel schedule has one shard's S (and the collectives' latency) once, so a
    placement may beat it (``docs/schedulers.md``, "Vocabulary parallelism").
    """
    from .builders import build_schedule, get_spec  # the builders import this module's placement

    spec = get_spec(name)
    probe = build_schedule(name, stages, microbatches, chunks=chunks, validate=False)
    placement = probe.placement
    resolved = spec.resolve_costs(costs, stages).resolve(placement)
    share = [1.0 / len(placement.stages_of(placement.rank_of(s))) for s in range(placement.num_stages)]
    rank_of = placement.stage_ranks
    s_part = [resolved.vocab_s[rank_of[s]] * share[s] / 2 for s in range(placement.num_stages)]
    t_part = [resolved.vocab_t[rank_of[s]] * share[s] for s in range(placement.num_stages)]
    folded = CostModel(
        f=tuple(f + x for f, x in zip(resolved.f, s_part)),
        b=tuple(b + x for b, x in zip(resolved.b, s_part)),
        w=tuple(w + x for w, x in zip(resolved.w, t_part)),
        comm=resolved.comm,
        mem_b=resolved.mem_b,
        mem_w=resolved.mem_w,
        memory_limit=None if spec.fixed_memory_limit else costs.memory_limit,
    )
    built = build_schedule(name, stages, microbatches, folded, chunks=chunks, validate=False)
    return simulate(built, folded).iteration_time


def work_bound(
    name: str, stages: int, microbatches: int, costs: CostModel, *, chunks: int | None = None
) -> float:
    """A true lower bound on the iteration time of schedule ``name`` with a vocabulary-parallel head:
    the busiest rank's compute, its stages' F, B, W and its shard's S and T for every microbatch
    (a rank's span holds all its work; no transfer, warm-up or memory limit is counted)."""
    from .builders import build_schedule, get_spec  # the builders import this module's placement

    probe = build_schedule(name, stages, microbatches, chunks=chunks, validate=False)
    resolved = get_spec(name).resolve_costs(costs, stages).resolve(probe.placement)
    return max(resolved.rank_work(r, microbatches, vocab=True) for r in range(probe.num_ranks))


@dataclass(frozen=True)
class HeadCosts:
    """The output layer's costs (time in FLOPs / ``flops_per_time_unit``, memory in bytes), plain
    (on the last stage, added to its F, B, W and M_B) or vocabulary-parallel (per shard)."""

    plain_f: float
    plain_b: float
    plain_w: float
    plain_mem: float
    vocab_s: float
    vocab_t: float
    vocab_mem: float

    def plain(self, costs: CostModel, num_ranks: int) -> CostModel:
        """``costs`` (per rank-stage, one value or ``num_ranks``) with the head on the last stage."""

        def plus(value: float | tuple[float, ...], extra: float) -> tuple[float, ...]:
            values = list(value) if isinstance(value, tuple) else [value] * num_ranks
            if len(values) != num_ranks:
                raise ScheduleError(
                    f"head_costs needs per-rank costs ({num_ranks} values), got {len(values)}"
                )
            values[-1] += extra
            return tuple(values)

        return costs.replace(
            f=plus(costs.f, self.plain_f),  # type: ignore[arg-type]
            b=plus(costs.b, self.plain_b),  # type: ignore[arg-type]
            w=plus(costs.w, self.plain_w),  # type: ignore[arg-type]
            mem_b=plus(costs.mem_b, self.plain_mem),  # type: ignore[arg-type]
        )

    def vocab(self, costs: CostModel, *, comm: float = 0.0) -> CostModel:
        """``costs`` with the head's costs per shard (S, T, their memory, the collectives' latency)."""
        return costs.replace(
            vocab_s=self.vocab_s, vocab_t=self.vocab_t, vocab_mem=self.vocab_mem, vocab_comm=comm
        )


def head_costs(
    *,
    hidden: int,
    vocab: int,
    tokens: int,
    shards: int,
    flops_per_time_unit: float = 1.0,
    logit_bytes: int = 4,
    activation_bytes: int = 2,
) -> HeadCosts:
    """The output layer's costs for ``tokens`` tokens per microbatch (FLOP counts as the paper's).

    Plain: F = 2·n·h·V (the logits; the softmax is ``O(n·V)`` and omitted), B = 2·n·h·V (the input
    gradient), W = 2·n·h·V, and the forward keeps the logits (``logit_bytes`` each) for the backward.
    Vocabulary-parallel, per shard of ``V/p`` rows: S = 4·n·h·V/p (the logits and their product with
    the weight for the input gradient), T = 2·n·h·V/p (the weight gradient); S keeps its logits and
    a copy of the hidden states (``activation_bytes`` each) until T.
    """
    for name, value in (("hidden", hidden), ("vocab", vocab), ("tokens", tokens), ("shards", shards)):
        if value < 1:
            raise ScheduleError(f"{name} must be at least 1, got {value}")
    if vocab < shards:
        raise ScheduleError(
            f"a vocabulary of {vocab} cannot be cut into {shards} shards (one row each at least)"
        )
    n, h, v = float(tokens), float(hidden), float(vocab)
    unit = 1.0 / flops_per_time_unit
    rows = math.ceil(vocab / shards)
    return HeadCosts(
        plain_f=2 * n * h * v * unit,
        plain_b=2 * n * h * v * unit,
        plain_w=2 * n * h * v * unit,
        plain_mem=n * v * logit_bytes,
        vocab_s=4 * n * h * rows * unit,
        vocab_t=2 * n * h * rows * unit,
        vocab_mem=n * rows * logit_bytes + n * h * activation_bytes,
    )


__all__ = [
    "CRAMPED_RETRIES",
    "MEMORY_SLACK",
    "RESERVED_MICROBATCHES",
    "TIME_TOLERANCE",
    "HeadCosts",
    "VocabPolicy",
    "add_vocab_ops",
    "deepened",
    "default_policies",
    "head_costs",
    "partition_reference",
    "place_vocab_ops",
    "refined_policies",
    "vocab_budgets",
    "work_bound",
]
