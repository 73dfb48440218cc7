"""A differential fuzzer of the B/W split: generated stage modules against plain autograd.

Hypothesis draws stages from the grammar of ``_split_grammar.py`` (38 op kinds and 6 entries from
integer ids) and places them as a first stage (integer ids, or a float input needing no gradient),
a middle stage or a last stage (a loss).  Each stage runs, in one process, under every split that
can apply — fast paths with routing and the generic split, the generic split alone, the fast paths
alone (what 1F1B runs) — with microbatches taking B then W or a fused BW in a drawn order, and
forwards running ahead of backwards.  Against one plain per-microbatch backward of the same stage
built from the same seed, every run must give: the same set of parameters with gradients, every
gradient and input gradient within 1e-6 relative (bf16 autocast: the precision of bf16), the same
outputs and buffers, each parameter's ``register_hook`` and post-accumulate hooks fired as often as
plain autograd fires them, never in B and always with ``.grad`` set.  A second test runs two
generated chunks on one rank through the executor's zb-v program.

The number of examples follows the test profile (``tests/conftest.py``): 100 in the quick run, 300
in CI's profile, 5,000 in the long one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from _dist import LocalComm
from _profile import fuzz_examples, profile
from _split_grammar import ENTRIES, OPS, SEQ, VOCAB, WIDTH, BlockChoice, OpChoice, build_stage
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from zerobubble.runtime.execute.executor import Executor, StageState
from zerobubble.runtime.wgrad import FastPaths, WeightGradStore, install_deferral
from zerobubble.schedule import build_schedule

EXAMPLES = fuzz_examples()
SLOW = profile() == "long"
MICROBATCHES = 3
BATCH = 2
SPLITS = ("fast paths", "generic only", "fast paths only")
POSITIONS = ("first, ids", "first, no-grad input", "middle", "last")

# the slow profile runs for many minutes: pytest-timeout's 300 s would end it
slow_enough = pytest.mark.timeout(7200 if SLOW else 300)

fuzz_settings = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not SLOW,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclass(frozen=True)
class Case:
    """One generated stage and how it runs."""

    blocks: tuple[BlockChoice, ...]
    position: str
    tie: bool
    autocast: bool
    seed: int
    deferred: tuple[bool, ...]  # per microbatch: B then W (True) or a fused BW
    ahead: int  # forwards run this many microbatches ahead of the backwards
    w_order: tuple[int, ...]  # the order of the W ops, after the last backward
    precision: torch.dtype | None = None  # the parameters' dtype, when not the default below

    @property
    def first(self) -> bool:
        return self.position.startswith("first")

    @property
    def dtype(self) -> torch.dtype:
        if self.precision is not None:
            return self.precision
        return torch.float32 if self.autocast else torch.float64


op_choices = st.builds(
    OpChoice, kind=st.sampled_from(sorted(OPS)), on_child=st.booleans(), residual=st.booleans()
)


@st.composite
def cases(draw) -> Case:
    position = draw(st.sampled_from(POSITIONS))
    count = draw(st.integers(1, 3))
    blocks = []
    for index in range(count):
        entry = None
        # a first stage on ids starts with an entry; one on a float input may add one
        optional = position == "first, no-grad input" and draw(st.booleans())
        if index == 0 and (position == "first, ids" or optional):
            entry = draw(st.sampled_from(sorted(ENTRIES)))
        ops = tuple(draw(st.lists(op_choices, min_size=1, max_size=4)))
        blocks.append(BlockChoice(entry, ops))
    deferred = tuple(draw(st.lists(st.booleans(), min_size=MICROBATCHES, max_size=MICROBATCHES)))
    return Case(
        blocks=tuple(blocks),
        position=position,
        tie=draw(st.booleans()),
        autocast=draw(st.integers(0, 7)) == 0,
        seed=draw(st.integers(0, 2**16)),
        deferred=deferred,
        ahead=draw(st.integers(1, MICROBATCHES)),
        w_order=tuple(draw(st.permutations(range(MICROBATCHES)))),
    )


# -- running a stage -------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one run of a stage over the microbatches produced."""

    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    input_grads: list[torch.Tensor | None] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    hooks: Counter[str] = field(default_factory=Counter)
    misfired: list[str] = field(default_factory=list)


def _inputs(case: Case) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(case.seed + 1)
    batches = []
    for _ in range(MICROBATCHES):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        if case.position == "first, ids":
            batches.append((ids,))
        else:
            # drawn in float64 whatever the case's dtype: the same values for the rounding reference
            batches.append(
                (torch.randn(BATCH, SEQ, WIDTH, generator=generator, dtype=torch.float64).to(case.dtype), ids)
            )
    return batches


def _cotangents(case: Case) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(case.seed + 2)
    draws = [
        torch.randn(BATCH, SEQ, WIDTH, generator=generator, dtype=torch.float64) for _ in range(MICROBATCHES)
    ]
    return [draw.to(case.dtype) for draw in draws]


def _stage_inputs(case: Case, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    if case.first:
        return tuple(t.clone() for t in batch)
    return (batch[0].clone().requires_grad_(), batch[1])


def _watch_hooks(stage: nn.Module, outcome: Outcome, in_b: list[bool]) -> None:
    """Count every parameter's hooks; note any that fire in B or without ``.grad``."""
    for name, param in stage.named_parameters():
        if not param.requires_grad:
            continue

        def pre(grad, name=name):
            outcome.hooks[f"{name} grad hook"] += 1
            if in_b[0]:
                outcome.misfired.append(f"{name}: register_hook hook fired in B")

        def post(param, name=name):
            outcome.hooks[f"{name} post hook"] += 1
            if in_b[0]:
                outcome.misfired.append(f"{name}: post-accumulate hook fired in B")
            if param.grad is None:
                outcome.misfired.append(f"{name}: post-accumulate hook fired with .grad None")

        param.register_hook(pre)
        param.register_post_accumulate_grad_hook(post)


def _forward(case: Case, stage: nn.Module, inputs: tuple[torch.Tensor, ...], j: int) -> torch.Tensor:
    torch.manual_seed(1000 + j)  # dropout draws the same masks in every run
    if case.autocast:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return stage(*inputs)[0]
    return stage(*inputs)[0]


def _backward_roots(case: Case, out: torch.Tensor, cotangent: torch.Tensor) -> torch.Tensor:
    if case.position == "last":
        return F.mse_loss(out.float(), cotangent.float())
    return (out * cotangent.to(out.dtype)).sum()


def _finish(case: Case, stage: nn.Module, outcome: Outcome) -> Outcome:
    outcome.grads = {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
    outcome.buffers = {n: b.clone() for n, b in stage.named_buffers()}
    return outcome


def run_plain(case: Case) -> Outcome:
    """One plain forward and backward per microbatch: the reference."""
    stage = build_stage(list(case.blocks), case.first, case.tie, case.dtype, case.seed)

    outcome = Outcome()
    _watch_hooks(stage, outcome, [False])
    for j, (batch, cotangent) in enumerate(zip(_inputs(case), _cotangents(case))):
        inputs = _stage_inputs(case, batch)
        out = _forward(case, stage, inputs, j)
        if out.requires_grad:  # a first stage of parameter-free ops has nothing to differentiate
            _backward_roots(case, out, cotangent).backward()
        outcome.outputs.append(out.detach())
        outcome.input_grads.append(None if case.first else inputs[0].grad)
    return _finish(case, stage, outcome)


def rounding(case: Case, expected: Outcome) -> dict[str, float]:
    """Per parameter gradient, input gradient (``"input j"``), output (``"output j"``) and float
    buffer (``"buffer name"``: a norm's running statistics), how far
    bf16 autocast's own rounding moves plain autograd's (the float32 run without autocast against
    ``expected``): the split may differ from plain autocast by as much, since it rounds the same
    bf16 products in another order.  Empty without autocast."""
    if not case.autocast:
        return {}
    exact = run_plain(Case(**{**case.__dict__, "autocast": False, "precision": torch.float32}))
    noise = {
        name: _relative(grad, exact.grads[name])
        for name, grad in expected.grads.items()
        if name in exact.grads
    }
    for j, (got, want) in enumerate(zip(expected.input_grads, exact.input_grads)):
        if got is not None and want is not None:
            noise[f"input {j}"] = _relative(got, want)
    for j, (got, want) in enumerate(zip(expected.outputs, exact.outputs)):
        noise[f"output {j}"] = _relative(got, want)
    floor = _buffer_floor(case, expected)
    for name, buffer in expected.buffers.items():
        if buffer.is_floating_point() and name in exact.buffers:
            noise[f"buffer {name}"] = _relative(buffer, exact.buffers[name], floor)
    return noise


def _buffer_floor(case: Case, expected: Outcome) -> float:
    """The divisor's floor for float buffers: under bf16 autocast (three significant digits) a
    running statistic near zero — the mean after a norm — is compared on the stage's buffers' scale,
    as a gradient near zero is on its gradients' (:func:`differences`)."""
    if not case.autocast:
        return 1e-12
    norms = [b.double().norm().item() for b in expected.buffers.values() if b.is_floating_point()]
    return max(1e-2 * max(norms, default=0.0), 1e-12)


def run_split(case: Case, split: str) -> Outcome:
    """The same microbatches through the split: forwards ahead, B then W or a fused BW, Ws last."""
    stage = build_stage(list(case.blocks), case.first, case.tie, case.dtype, case.seed)
    store = WeightGradStore()
    paths = {"fast paths": None, "generic only": FastPaths(), "fast paths only": None}[split]
    generic = split != "fast paths only"
    install_deferral([stage], store, paths, generic=generic)
    deferred = case.deferred if generic else (False,) * MICROBATCHES
    outcome = Outcome()
    in_b = [False]
    _watch_hooks(stage, outcome, in_b)
    batches, cotangents = _inputs(case), _cotangents(case)
    saved: dict[int, tuple[tuple[torch.Tensor, ...], torch.Tensor]] = {}
    outcome.outputs = [torch.empty(0)] * MICROBATCHES
    outcome.input_grads = [None] * MICROBATCHES
    forwarded = 0

    def forward_next() -> None:
        nonlocal forwarded
        j = forwarded
        inputs = _stage_inputs(case, batches[j])
        with store.keyed_forward((0, j)):
            out = _forward(case, stage, inputs, j)
        saved[j] = inputs, out
        outcome.outputs[j] = out.detach()
        forwarded += 1

    for j in range(MICROBATCHES):
        while forwarded < min(MICROBATCHES, j + case.ahead):
            forward_next()
        inputs, out = saved.pop(j)
        if not out.requires_grad:
            continue
        before = {n: None if p.grad is None else p.grad.clone() for n, p in stage.named_parameters()}
        root = _backward_roots(case, out, cotangents[j])
        store.begin((0, j), deferred[j])
        in_b[0] = deferred[j]
        try:
            root.backward()
        finally:
            in_b[0] = False
            store.end()
        if deferred[j]:
            for name, param in stage.named_parameters():
                if not _same(param.grad, before[name]):
                    outcome.misfired.append(f"{name}: .grad changed in B of microbatch {j}")
        outcome.input_grads[j] = None if case.first else inputs[0].grad
    for j in case.w_order:
        store.flush((0, j))
    if store.pending_keys():
        outcome.misfired.append(f"work left in the store: {store.pending_keys()}")
    return _finish(case, stage, outcome)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _tolerance(case: Case) -> float:
    # bf16 autocast: the split and autograd may round the same bf16 products in another order
    return 2e-2 if case.autocast else 1e-6


def _relative(actual: torch.Tensor, expected: torch.Tensor, floor: float = 1e-12) -> float:
    """``‖actual − expected‖ / ‖expected‖``; ``floor`` bounds the divisor below (a gradient that is
    zero in exact arithmetic, rounding noise in bf16, is compared on the stage's scale)."""
    scale = expected.double().norm().item()
    return (actual.double() - expected.double()).norm().item() / max(scale, floor)


def differences(
    case: Case, actual: Outcome, expected: Outcome, noise: dict[str, float] | None = None
) -> list[str]:
    """Every way ``actual`` differs from the plain reference (empty when exact); ``noise``: what
    bf16 rounding alone does to each gradient (:func:`rounding`), which widens its tolerance."""
    tolerance = _tolerance(case)
    noise = noise or {}
    found = list(actual.misfired)
    if set(actual.grads) != set(expected.grads):
        found.append(f"parameters with gradients: {sorted(actual.grads)} != {sorted(expected.grads)}")
    largest = max((grad.double().norm().item() for grad in expected.grads.values()), default=0.0)
    floor = max(1e-4 * largest, 1e-12)
    for name in set(actual.grads) & set(expected.grads):
        error = _relative(actual.grads[name], expected.grads[name], floor)
        if error > max(tolerance, 3 * noise.get(name, 0.0)):
            found.append(f"{name}: gradient off by {error:.2e} relative")
    for j, (got, want) in enumerate(zip(actual.input_grads, expected.input_grads)):
        limit = max(tolerance, 3 * noise.get(f"input {j}", 0.0))
        if (got is None) != (want is None) or (want is not None and _relative(got, want) > limit):
            found.append(f"input gradient of microbatch {j} differs")
    for j, (got, want) in enumerate(zip(actual.outputs, expected.outputs)):
        if _relative(got, want) > max(tolerance, 3 * noise.get(f"output {j}", 0.0)):
            found.append(f"output of microbatch {j} differs")
    buffer_floor = _buffer_floor(case, expected)
    for name, want in expected.buffers.items():
        got = actual.buffers[name]
        limit = max(tolerance, 3 * noise.get(f"buffer {name}", 0.0))
        if (want.is_floating_point() and _relative(got, want, buffer_floor) > limit) or (
            not want.is_floating_point() and not torch.equal(got, want)
        ):
            found.append(f"buffer {name} differs")
    if actual.hooks != expected.hooks:
        found.append(f"hooks fired {dict(actual.hooks)} times, plain autograd {dict(expected.hooks)}")
    return found


def describe(case: Case) -> str:
    blocks = "; ".join(
        (f"[{block.entry}] " if block.entry else "")
        + ", ".join(
            f"{op.kind}{' (child)' if op.on_child else ''}{' (residual)' if op.residual else ''}"
            for op in block.ops
        )
        for block in case.blocks
    )
    return (
        f"{case.position}{', tied' if case.tie else ''}{', bf16 autocast' if case.autocast else ''}: {blocks}"
    )


@pytest.mark.fuzz
@slow_enough
@fuzz_settings
@given(case=cases())
def test_generated_stages_split_as_plain_autograd(case):
    expected = run_plain(case)
    noise = rounding(case, expected)
    problems = {split: differences(case, run_split(case, split), expected, noise) for split in SPLITS}
    problems = {split: found for split, found in problems.items() if found}
    assert not problems, f"{describe(case)}\n{problems}"


# -- two chunks on one rank ------------------------------------------------------------------------


class _Chunk(nn.Module):
    """One chunk of a zb-v pipeline on one rank: a generated stage, its ids passed along."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.stage = stage

    def forward(self, *inputs):
        return self.stage(*inputs)


def _without_dropout(case: Case) -> Case:
    """``case`` with each dropout op an activation: the executor seeds each forward its own way,
    so dropout masks would differ from the reference's; everything else is compared."""

    def swap(op: OpChoice) -> OpChoice:
        return OpChoice("activation", op.on_child, op.residual) if op.kind == "dropout" else op

    blocks = tuple(BlockChoice(block.entry, tuple(swap(op) for op in block.ops)) for block in case.blocks)
    return Case(**{**case.__dict__, "blocks": blocks})


def _chunk_loss(outputs, target):
    return F.mse_loss(outputs[0].float(), target.float())


@pytest.mark.fuzz
@slow_enough
@settings(fuzz_settings, max_examples=max(EXAMPLES // 10, 30))
@given(first=cases(), second=cases())
def test_two_generated_chunks_on_one_rank_train_as_one_process(first, second):
    """zb-v's program on one rank: chunk 0 (drawn first stage) and chunk 1 (drawn last stage), local
    hand-overs, each chunk's own store, against one plain backward of the mean loss."""
    first = Case(**{**first.__dict__, "position": "first, ids", "autocast": False})
    if first.blocks[0].entry is None:
        first = Case(
            **{
                **first.__dict__,
                "blocks": (BlockChoice("embedding", first.blocks[0].ops), *first.blocks[1:]),
            }
        )
    second = Case(
        **{
            **second.__dict__,
            "position": "last",
            "autocast": False,
            "blocks": tuple(BlockChoice(None, b.ops) for b in second.blocks),
        }
    )
    first, second = _without_dropout(first), _without_dropout(second)
    microbatches = 4
    generator = torch.Generator().manual_seed(first.seed)
    inputs = [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),) for _ in range(microbatches)]
    targets = [
        torch.randn(BATCH, SEQ, WIDTH, generator=generator, dtype=torch.float64) for _ in range(microbatches)
    ]

    def chunks() -> list[nn.Module]:
        return [
            _Chunk(build_stage(list(first.blocks), True, first.tie, torch.float64, first.seed)),
            _Chunk(build_stage(list(second.blocks), False, second.tie, torch.float64, second.seed)),
        ]

    reference = chunks()
    losses = []
    for j, ((ids,), target) in enumerate(zip(inputs, targets)):
        torch.manual_seed(j)
        losses.append(_chunk_loss(reference[1](*reference[0](ids)), target))
    pipelined = chunks()
    (sum(losses) / microbatches).backward()
    stages = {}
    for index, chunk in enumerate(pipelined):
        store = WeightGradStore()
        install_deferral([chunk], store)
        stages[index] = StageState(index, chunk, store, index == 0, index == 1, f"chunk {index}")
    executor = Executor(build_schedule("zb-v", 1, microbatches), 0, stages, LocalComm(), _chunk_loss)  # type: ignore[arg-type]
    executor.run_step(inputs, targets)
    found = []
    largest = max(
        p.grad.norm().item() for chunk in reference for p in chunk.parameters() if p.grad is not None
    )
    floor = 1e-4 * largest  # a gradient zero in exact arithmetic (a shift before a batch norm) is noise
    for chunk, expected in zip(pipelined, reference):
        grads = {n: p.grad for n, p in expected.named_parameters() if p.grad is not None}
        got = {n: p.grad for n, p in chunk.named_parameters() if p.grad is not None}
        if set(got) != set(grads):
            found.append(f"parameters with gradients: {sorted(got)} != {sorted(grads)}")
        errors = {n: _relative(got[n], g, floor) for n, g in grads.items() if n in got}
        found += [f"{n}: off by {error:.2e}" for n, error in errors.items() if error > 1e-6]
    assert not found, f"{describe(first)} | {describe(second)}\n{found}"


@pytest.mark.parametrize("kind", sorted(OPS))
def test_every_op_kind_splits_exactly_at_every_position(kind):
    """Each op of the grammar on its own, on the block and on a child, at each position: the
    fuzzer's coverage does not depend on what the draw happens to pick."""
    for position in POSITIONS:
        for on_child in (False, True):
            entry = "embedding" if position == "first, ids" else None
            case = Case(
                blocks=(BlockChoice(entry, (OpChoice(kind, on_child, False),)),),
                position=position, tie=False, autocast=False, seed=7,
                deferred=(True, False, True), ahead=2, w_order=(2, 0, 1),
            )  # fmt: skip
            expected = run_plain(case)
            for split in SPLITS:
                found = differences(case, run_split(case, split), expected)
                assert not found, f"{describe(case)} [{split}]: {found}"
