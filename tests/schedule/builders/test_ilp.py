"""The zb-ilp builder (paper Appendix G integer program) and the analytic lower bounds."""

import itertools
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

import zerobubble
from zerobubble.schedule.bounds import lower_bound, lower_bound_makespan
from zerobubble.schedule.builders import REGISTRY, build_schedule, zb_ilp
from zerobubble.schedule.costs import CostModel
from zerobubble.schedule.ir import B, F, Kind, Op, Placement, Schedule, ScheduleError, W
from zerobubble.schedule.paper import row_costs
from zerobubble.schedule.simulate import simulate
from zerobubble.schedule.validate import validate_schedule

TABLE5 = Path(zerobubble.__file__).parent / "data" / "paper_table5.json"  # the paper's Table 5, shipped


def random_costs(rng, p, limit_factor):
    """Per-stage costs within ±15% of random means, transfer time, a limit of ``limit_factor``·p·max M_B.

    Near-uniform stages keep every rank close to critical, so the solver (not the analytic bound
    alone) has to settle the order.
    """

    def noisy(base):
        return [round(base * rng.uniform(0.85, 1.15), 3) for _ in range(p)]

    mem_b = noisy(1.0)
    costs = CostModel(
        f=noisy(rng.uniform(0.8, 1.5)),
        b=noisy(rng.uniform(0.8, 1.5)),
        w=noisy(rng.uniform(0.3, 1.0)),
        comm=noisy(rng.uniform(0.0, 0.3)),
        mem_b=mem_b,
        mem_w=[m * rng.uniform(0.1, 0.5) for m in mem_b],
    )
    return costs.with_memory_limit(limit_factor * max(mem_b) * p)


def incumbent_time(p, m, costs):
    """zb-auto's iteration time under the same limit, or None when it cannot meet the limit."""
    try:
        return simulate(build_schedule("zb-auto", p, m, costs), costs).iteration_time
    except ScheduleError:
        return None


def brute_force_optimum(p, m, costs):
    """Best simulated iteration time over every per-rank order of split F/B/W ops that fits memory."""
    placement = Placement.loop(p)
    resolved = costs.resolve(placement)

    def rank_orders(rank):
        ops = [Op(kind, rank, j) for j in range(m) for kind in (Kind.F, Kind.B, Kind.W)]
        for order in itertools.permutations(ops):
            where = {op: i for i, op in enumerate(order)}
            if not all(
                where[Op(Kind.F, rank, j)] < where[Op(Kind.B, rank, j)] < where[Op(Kind.W, rank, j)]
                for j in range(m)
            ):
                continue
            levels = itertools.accumulate(resolved.memory_delta(op) for op in order)
            if all(level <= resolved.memory_limit[rank] * (1 + 1e-9) for level in levels):
                yield order

    best = math.inf
    for programs in itertools.product(*(list(rank_orders(r)) for r in range(p))):
        try:
            best = min(best, simulate(Schedule("brute", placement, m, programs), resolved).iteration_time)
        except ScheduleError:
            continue
    return best


def check_result(schedule, p, m, costs):
    """The schedule validates, respects memory and reports its true simulated numbers."""
    timeline = validate_schedule(schedule, costs)
    limits = costs.resolve(schedule.placement).memory_limit
    assert all(peak <= limit * (1 + 1e-9) for peak, limit in zip(timeline.peak_memory, limits))
    assert schedule.splits_backward
    assert schedule.meta["iteration_time"] == pytest.approx(timeline.iteration_time, rel=1e-12)
    assert schedule.meta["lower_bound"] <= timeline.iteration_time * (1 + 1e-9)
    assert schedule.meta["lower_bound"] >= lower_bound(p, m, costs) * (1 - 1e-9)
    json.loads(schedule.to_json())
    return timeline


@pytest.mark.parametrize("seed", range(10))
def test_small_random_problems_are_solved_to_proven_optimality(seed):
    rng = random.Random(seed)
    p, m = [(2, 4), (2, 6), (3, 4), (3, 6), (4, 4), (4, 5), (3, 8), (4, 6), (2, 8), (4, 3)][seed]
    costs = random_costs(rng, p, rng.choice([1.0, 1.5, 2.0]))
    schedule = build_schedule("zb-ilp", p, m, costs, time_limit=30)
    timeline = check_result(schedule, p, m, costs)
    assert schedule.meta["optimal"] is True
    assert schedule.meta["solver_status"] in ("optimal", "bound", "relaxation_bound")
    assert schedule.meta["lower_bound"] == pytest.approx(timeline.iteration_time, rel=1e-5)
    heuristic = incumbent_time(p, m, costs)
    if heuristic is not None:
        assert timeline.iteration_time <= heuristic * (1 + 1e-12)


def admits(model, schedule, costs):
    """Whether the integer program's rows and bounds accept a known schedule's simulated times and order."""
    timeline = simulate(schedule, costs)
    program = model.formulate()
    point = model.encode(
        [list(p) for p in schedule.programs], [list(e) for e in timeline.end], timeline.iteration_time
    )
    tolerance = 1e-7
    if np.any(point < program.bounds.lb - tolerance) or np.any(point > program.bounds.ub + tolerance):
        return False
    if program.constraints is None:
        return True
    values = program.constraints.A @ point
    return bool(
        np.all(values >= program.constraints.lb - tolerance)
        and np.all(values <= program.constraints.ub + tolerance)
    )


@pytest.mark.parametrize("seed", range(6))
def test_strengthened_program_admits_the_incumbent_and_the_optimum(seed):
    # The cuts and fixings derived from the incumbent's bound must never exclude a schedule that
    # reaches the bound: the incumbent itself, and the optimum the plain program finds.
    rng = random.Random(200 + seed)
    p, m = [(3, 5), (4, 4), (3, 6), (2, 6), (4, 5), (3, 4)][seed]
    costs = random_costs(rng, p, rng.choice([1.0, 1.5, 2.0]))
    placement = Placement.loop(p)
    resolved = costs.resolve(placement)
    incumbent = zb_ilp._best_incumbent(p, m, costs, resolved)
    upper = incumbent.timeline.iteration_time
    strong = zb_ilp._OrderModel(resolved, m, upper, lower_bound(p, m, costs))
    plain = zb_ilp._OrderModel(resolved, m, upper, 0.0, strengthen=False)
    assert admits(strong, incumbent.schedule, costs) and admits(plain, incumbent.schedule, costs)
    plain_programs, plain_report = plain.solve(30.0)
    strong_programs, strong_report = strong.solve(30.0)
    plain_best = (
        upper
        if plain_programs is None
        else simulate(Schedule("p", placement, m, plain_programs), costs).iteration_time
    )
    assert plain_report.status in ("optimal", "relaxation_bound")
    assert strong_report.dual_bound <= plain_best * (1 + 1e-6)
    if plain_programs is not None:
        assert admits(strong, Schedule("p", placement, m, plain_programs), costs)
    if strong_programs is not None:
        strong_best = simulate(Schedule("s", placement, m, strong_programs), costs).iteration_time
        assert strong_best == pytest.approx(plain_best, rel=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_optimum_matches_exhaustive_search(seed):
    rng = random.Random(100 + seed)
    p, m = (3, 2) if seed == 0 else (2, 2)
    costs = random_costs(rng, p, rng.choice([0.7, 1.0, 2.0]))
    schedule = build_schedule("zb-ilp", p, m, costs, time_limit=30)
    check_result(schedule, p, m, costs)
    assert schedule.meta["optimal"] is True
    assert schedule.meta["iteration_time"] == pytest.approx(brute_force_optimum(p, m, costs), rel=1e-9)


def test_memory_limit_is_respected_when_it_binds():
    costs = CostModel(f=1.0, b=1.0, w=1.0, comm=0.1, mem_b=1.0, mem_w=0.5)
    tight = build_schedule("zb-ilp", 3, 6, costs.with_memory_limit(1.5))
    loose = build_schedule("zb-ilp", 3, 6, costs.with_memory_limit(6.0))
    assert max(simulate(tight, costs).peak_memory) <= 1.5 + 1e-9
    assert tight.meta["optimal"] and loose.meta["optimal"]
    assert loose.meta["iteration_time"] < tight.meta["iteration_time"]


def test_time_limit_returns_the_best_known_schedule():
    p, m = 5, 10
    costs = random_costs(random.Random(0), p, 1.3)
    schedule = build_schedule("zb-ilp", p, m, costs, time_limit=2.0)
    timeline = check_result(schedule, p, m, costs)
    assert schedule.meta["solver_status"] == "time_limit"
    assert schedule.meta["optimal"] is False
    assert schedule.meta["lower_bound"] < timeline.iteration_time
    assert schedule.meta["time"] < 10
    assert timeline.iteration_time <= schedule.meta["incumbent_iteration_time"] * (1 + 1e-12)
    heuristic = incumbent_time(p, m, costs)
    if heuristic is not None:
        assert timeline.iteration_time <= heuristic * (1 + 1e-12)


def test_oversized_problem_returns_the_incumbent_without_a_program():
    costs = CostModel(f=1.0, b=1.1, w=0.6, comm=0.05, mem_b=1.0, mem_w=0.3, memory_limit=3.0)
    schedule = build_schedule("zb-ilp", 3, 200, costs)
    check_result(schedule, 3, 200, costs)
    assert schedule.meta["solver_status"] == "too_large"
    assert schedule.meta["source"] == schedule.meta["incumbent"]


@pytest.mark.parametrize(
    "request_kwargs, message",
    [({"chunks": 2}, "chunk"), ({"time_limit": 0}, "time_limit"), ({"time_limit": "fast"}, "time_limit")],
)
def test_bad_requests_raise_schedule_errors(request_kwargs, message):
    with pytest.raises(ScheduleError, match=message):
        build_schedule("zb-ilp", 2, 2, CostModel(), **request_kwargs)


def test_limit_below_one_microbatch_is_rejected():
    with pytest.raises(ScheduleError, match="memory"):
        build_schedule("zb-ilp", 2, 4, CostModel(mem_b=2.0, memory_limit=1.0))


def test_lower_bound_equals_zb_h1_for_unit_costs_under_1p():
    # Rank 0 waits (p-1)·T_B for its first B with only p forwards in memory: 24 + 3 for p=4, m=8,
    # which is exactly ZB-H1's (p-1)(T_F+T_B-T_W) bubble, so the bound is tight there.
    costs = CostModel(f=1.0, b=1.0, w=1.0, mem_b=1.0, mem_w=0.0, memory_limit=4.0)
    assert lower_bound(4, 8, costs) == pytest.approx(27.0)
    assert lower_bound(4, 8, costs.with_memory_limit(None)) == pytest.approx(24.0)
    assert lower_bound(1, 5, CostModel(f=2.0, b=3.0, w=1.0)) == pytest.approx(30.0)
    assert lower_bound_makespan(1, 5, CostModel(f=2.0, b=3.0, w=1.0)) == pytest.approx(30.0)


def test_lower_bound_reproduces_paper_zb_1p_figure():
    row = json.loads(TABLE5.read_text())["rows"][0]
    p, m = row["stages"], row["microbatches"]
    costs = row_costs(row).with_memory_limit(p * row["mem_b"])
    ideal = m * (row["cost_f"] + row["cost_b"] + row["cost_w"])
    # The paper's zb-1p bubble rate for this row is 15.85% and its zb-2p one 4.33%: no schedule
    # under those limits can do better.
    assert 1 - ideal / lower_bound(p, m, costs) == pytest.approx(row["bubble_rate"]["zb-1p"], abs=1e-4)
    doubled = costs.with_memory_limit(2 * p * row["mem_b"])
    assert 1 - ideal / lower_bound(p, m, doubled) == pytest.approx(row["bubble_rate"]["zb-2p"], abs=1e-4)


def test_lower_bound_never_exceeds_any_registry_schedule():
    rng = random.Random(7)
    names = [name for name in REGISTRY if name not in ("zb-ilp", "dualpipe-v")]  # dualpipe-v: m ≥ 2p
    checked = 0
    for _ in range(40):
        p, m = rng.randint(1, 5), rng.randint(1, 10)
        heterogeneous = rng.random() < 0.5

        def values(lo, hi, p=p, heterogeneous=heterogeneous):
            if heterogeneous:
                return [round(rng.uniform(lo, hi), 2) for _ in range(p)]
            return round(rng.uniform(lo, hi), 2)

        mem_b = values(0.5, 2.0)
        base = CostModel(
            f=values(0.2, 3),
            b=values(0.2, 3),
            w=values(0.0, 3),
            comm=values(0.0, 1.0),
            mem_b=mem_b,
            mem_w=values(0.0, 0.4),
        )
        factor = rng.choice([None, 1.0, 1.5, 2.0, 3.0])
        costs = base if factor is None else base.with_memory_limit(factor * p * 2.0)
        for name in names:
            try:
                schedule = build_schedule(name, p, m, costs)
            except ScheduleError:
                continue
            timeline = simulate(schedule, costs)
            # The bound must hold for any schedule with this schedule's own peak memory.
            own = costs.with_memory_limit(list(timeline.peak_memory))
            bound = lower_bound(p, m, own, placement=schedule.placement)
            assert bound <= timeline.iteration_time * (1 + 1e-9), (name, p, m, costs)
            assert lower_bound_makespan(p, m, own, placement=schedule.placement) <= timeline.makespan * (
                1 + 1e-9
            )
            assert bound >= timeline.ideal * (1 - 1e-12)
            checked += 1
    assert checked > 100


@pytest.mark.long
def test_paper_1_5b_setup_improves_on_zb_2p_or_proves_it_optimal():
    row = json.loads(TABLE5.read_text())["rows"][0]
    p, m = row["stages"], row["microbatches"]
    costs = row_costs(row).with_memory_limit(2 * p * row["mem_b"])
    schedule = build_schedule("zb-ilp", p, m, costs, time_limit=60)
    timeline = check_result(schedule, p, m, costs)
    zb_2p = simulate(build_schedule("zb-2p", p, m, costs), costs).iteration_time
    assert timeline.iteration_time <= zb_2p * (1 + 1e-12)
    # Measured: within 60 s HiGHS neither beats zb-2p here nor lifts the bound above the analytic one.
    assert schedule.meta["lower_bound"] >= lower_bound(p, m, costs)
    if not schedule.meta["optimal"]:
        assert schedule.meta["solver_status"] == "time_limit"


def _random_order(rng: random.Random, placement: Placement, m: int) -> Schedule:
    """Every op of the placement in one random order that respects the dependencies."""
    S = placement.num_stages
    done: set[tuple[str, int, int]] = set()
    remaining = {(kind, s, j) for kind in "FBW" for s in range(S) for j in range(m)}

    def ready(kind: str, s: int, j: int) -> bool:
        if kind == "F":
            return s == 0 or ("F", s - 1, j) in done
        if kind == "B":
            return ("F", s, j) in done and (s == S - 1 or ("B", s + 1, j) in done)
        return ("B", s, j) in done

    programs: list[list] = [[] for _ in range(placement.num_ranks)]
    makers = {"F": F, "B": B, "W": W}
    while remaining:
        op = rng.choice(sorted(op for op in remaining if ready(*op)))
        remaining.discard(op)
        done.add(op)
        programs[placement.rank_of(op[1])].append(makers[op[0]](op[1], op[2]))
    return Schedule("random", placement, m, programs)


def test_lower_bound_never_exceeds_random_orders_with_two_chunks():
    """Random dependency-respecting orders on the V and the interleaved loop, bounded at their own
    peak memory (the warm-up term counts the forward chain from the rank's first stage)."""
    rng = random.Random(5)
    for trial in range(60):
        p, m = rng.randint(2, 5), rng.randint(1, 8)
        placement = Placement.vshape(p) if trial % 2 == 0 else Placement.loop(p, 2)
        S = placement.num_stages
        costs = CostModel(
            f=[rng.uniform(0.2, 3) for _ in range(S)],
            b=[rng.uniform(0.2, 3) for _ in range(S)],
            w=[rng.uniform(0.0, 3) for _ in range(S)],
            comm=rng.uniform(0.0, 0.5),
            mem_b=1.0,
            mem_w=rng.uniform(0.0, 0.6),
        )
        timeline = simulate(_random_order(rng, placement, m), costs)
        own = costs.with_memory_limit(list(timeline.peak_memory))
        assert timeline.iteration_time >= lower_bound(p, m, own, placement=placement) * (1 - 1e-9)


def test_the_v_warm_up_bound_counts_the_chain_to_the_up_stage():
    """Rank 0 of a V (p = 4, chunks of T_F/2, M_B/2): its first backward (of stage 7) waits for the
    forward chain through all 8 chunks, 8·0.5 + 6·0.1 (stages 3 and 4 share rank 3), after its
    first start; meanwhile only the 8 chunk-forwards that fit in a limit of 4 can run (4.0 of
    work).  So it idles 0.6 on top of its 48 of work (the old term, the last stage's own round trip,
    counted no warm-up wait)."""
    costs = CostModel(f=1.0, b=1.0, w=1.0, comm=0.1, mem_b=1.0, mem_w=0.0, memory_limit=4.0)
    assert lower_bound(4, 16, costs, placement=Placement.vshape(4)) == pytest.approx(48.6)
