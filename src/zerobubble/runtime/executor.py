"""Runs one rank's program of a :class:`~zerobubble.schedule.Schedule` for one training step.

The program is compiled once into a list of ``(op, handler, stage, microbatch)`` entries, one
handler per op kind (the ``handlers`` dispatch table, as in DeepSpeed's pipeline engine), so the
per-op cost of the loop is one call; replacing a handler and calling :meth:`Executor.compile` changes
what an op kind does (e.g. an emulation that sleeps for the modelled duration).  A *recorder* — any
object with ``op(op, start, end)`` and ``wait(key, start, end)`` — may be attached to time every op
and every transfer wait; without one the loop reads no clock.  A recorder may also provide
``clock()`` (whose values it then receives instead of ``time.perf_counter()`` seconds, e.g. CUDA
events) and ``begin_step()`` (called before each step's first op).

Each handler is a receive, a compute and a send, exposed as separate methods
(:meth:`Executor.receive_forward`, :meth:`Executor.compute_forward`, :meth:`Executor.send_forward`
and their backward counterparts) so another handler — an emulation that replaces the compute by a
timed wait, :mod:`.emulate` — can reuse the receive and the send unchanged.

Tensors between two chunks of the same rank (the tip of a V) are handed over in a dict, without
communication.  What a microbatch keeps alive follows the schedule: F keeps the stage's inputs and
outputs (and autograd's saved tensors); B frees all of them except what the deferred W needs (held
by the stage's :class:`WeightGradStore`), W frees the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..schedule.ir import Kind, Op, Schedule
from . import PipelineError
from .comm import Comm
from .wgrad import WeightGradStore


class StageState:
    """One virtual stage held by this rank: its module, its W store and its in-flight microbatches."""

    __slots__ = ("first", "index", "last", "module", "name", "next_local", "prev_local", "saved", "store")

    def __init__(
        self, index: int, module: nn.Module, store: WeightGradStore, first: bool, last: bool, name: str
    ):
        self.index = index
        self.module = module
        self.store = store
        self.first = first
        self.last = last
        self.name = name
        self.saved: dict[int, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {}
        self.next_local = False
        self.prev_local = False


class Executor:
    """Executes ``schedule.programs[rank]`` over this rank's ``stages`` (stage index → StageState).

    ``loss_fn(output, target)`` runs after the last stage; each microbatch's loss is scaled by
    ``1/m`` before its backward so the accumulated gradients are those of the mean loss.
    """

    def __init__(
        self, schedule: Schedule, rank: int, stages: dict[int, StageState], comm: Comm, loss_fn: Callable
    ):
        self.schedule = schedule
        self.rank = rank
        self.stages = stages
        self.comm = comm
        self.loss_fn = loss_fn
        self.recorder: Any = None
        self._placement = schedule.placement
        for index, state in stages.items():
            state.next_local = index + 1 in stages
            state.prev_local = index - 1 in stages
        self._handoff: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}
        self._inputs: Sequence[tuple[torch.Tensor, ...]] = ()
        self._targets: Sequence[Any] = ()
        self._losses: list[torch.Tensor] = []
        self._scale = 1.0 / schedule.microbatches
        self.handlers: dict[Kind, Callable[[StageState, int], None]] = {
            Kind.F: self._forward,
            Kind.B: self._backward,
            Kind.BW: self._backward_fused,
            Kind.W: self.compute_weight,
        }
        self.program: list[tuple[Op, Callable[[StageState, int], None], StageState, int]] = []
        self.compile()
        self._steps = 0

    def compile(self) -> None:
        """Bind every op of this rank's program to its handler (call again after changing ``handlers``)."""
        self.program = [
            (op, self.handlers[op.kind], self.stages[op.stage], op.microbatch)
            for op in self.schedule.programs[self.rank]
        ]

    def run_step(
        self, inputs: Sequence[tuple[torch.Tensor, ...]], targets: Sequence[Any]
    ) -> list[torch.Tensor]:
        """Run the program once; ``inputs``/``targets`` are per-microbatch (empty where unused).

        Returns the detached per-microbatch losses on the rank of the last stage, else ``[]``.
        """
        self._inputs, self._targets, self._losses = inputs, targets, []
        try:
            self.comm.start_step(first=self._steps == 0)
            recorder = self.recorder
            if recorder is None:
                for _, handler, state, microbatch in self.program:
                    handler(state, microbatch)
            else:
                self._run_recorded(recorder)
            self.comm.finish_step()
        except BaseException:
            self._abort()
            raise
        finally:
            self._inputs = self._targets = ()
        self._steps += 1
        return self._losses

    def _run_recorded(self, recorder: Any) -> None:
        begin = getattr(recorder, "begin_step", None)
        if begin is not None:
            begin()
        clock = getattr(recorder, "clock", time.perf_counter)
        record = recorder.op
        for op, handler, state, microbatch in self.program:
            started = clock()
            handler(state, microbatch)
            record(op, started, clock())

    def _abort(self) -> None:
        self.comm.abort_step()
        self._handoff.clear()
        for state in self.stages.values():
            state.saved.clear()
            state.store.clear()

    # -- handlers ----------------------------------------------------------------------------------

    def _forward(self, state: StageState, j: int) -> None:
        outputs = self.compute_forward(state, j, self.receive_forward(state, j))
        self.send_forward(state, j, outputs)

    def _backward(self, state: StageState, j: int) -> None:
        self._run_backward(state, j, defer=True)

    def _backward_fused(self, state: StageState, j: int) -> None:
        self._run_backward(state, j, defer=False)

    def compute_weight(self, state: StageState, j: int) -> None:
        """The W op: accumulate the deferred weight gradients of microbatch ``j`` into ``.grad``."""
        state.store.flush((state.index, j))

    def _run_backward(self, state: StageState, j: int, defer: bool) -> None:
        grads = self.receive_backward(state, j)
        self.send_backward(state, j, self.compute_backward(state, j, grads, defer))

    # -- the pieces of a handler ---------------------------------------------------------------------

    def receive_forward(self, state: StageState, j: int) -> tuple[torch.Tensor, ...]:
        """The inputs of F(state, j): the batch, a local hand-over or a received message."""
        return self._stage_inputs(state, j)

    def compute_forward(
        self, state: StageState, j: int, inputs: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]:
        """Run the stage's forward (and the loss on the last stage); keep what B needs; return the outputs."""
        try:
            outputs = state.module(*inputs)
        except Exception as error:
            raise PipelineError(self._forward_failure(state, j, inputs, error)) from error
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        if state.last:
            outputs = (self._loss(state, outputs, j),)
        state.saved[j] = (inputs, outputs)
        return outputs

    def send_forward(self, state: StageState, j: int, outputs: tuple[torch.Tensor, ...]) -> None:
        """Pass F's outputs to the next stage (nothing to pass from the last stage)."""
        if not state.last:
            self._pass_on(state, (0, state.index, j), tuple(t.detach() for t in outputs), forward=True)

    def receive_backward(self, state: StageState, j: int) -> tuple[torch.Tensor, ...] | None:
        """The gradient of the stage's outputs for microbatch ``j`` (None on the last stage: the loss)."""
        if state.last:
            return None
        key = (1, state.index, j)
        return self._handoff.pop(key) if state.next_local else self.comm.recv(key)

    def compute_backward(
        self, state: StageState, j: int, received: tuple[torch.Tensor, ...] | None, defer: bool
    ) -> tuple[torch.Tensor, ...]:
        """Backward of microbatch ``j`` (weight gradients deferred to W if ``defer``); the input gradients."""
        inputs, outputs = state.saved.pop(j)
        if received is None:
            tensors, grads = [outputs[0] * self._scale], None
        else:
            pairs = [(out, grad) for out, grad in zip(_floating(outputs), received) if out.requires_grad]
            tensors, grads = [p[0] for p in pairs], [p[1] for p in pairs]
        state.store.begin((state.index, j), defer)
        try:
            if tensors:
                torch.autograd.backward(tensors, grads)
        finally:
            state.store.end()
        if state.first:
            return ()
        return tuple(x.grad if x.grad is not None else torch.zeros_like(x) for x in _floating(inputs))

    def send_backward(self, state: StageState, j: int, input_grads: tuple[torch.Tensor, ...]) -> None:
        """Pass B's input gradients to the previous stage (nothing to pass from the first stage)."""
        if not state.first:
            self._pass_on(state, (1, state.index - 1, j), input_grads, forward=False)

    # -- helpers -----------------------------------------------------------------------------------

    def _stage_inputs(self, state: StageState, j: int) -> tuple[torch.Tensor, ...]:
        if state.first:
            return self._inputs[j]
        key = (0, state.index - 1, j)
        received = self._handoff.pop(key) if state.prev_local else self.comm.recv(key)
        return tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in received)

    def _loss(self, state: StageState, outputs: tuple[torch.Tensor, ...], j: int) -> torch.Tensor:
        output = outputs[0] if len(outputs) == 1 else outputs
        loss = self.loss_fn(output, self._targets[j])
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise PipelineError(
                f"loss_fn must return a scalar tensor (use a mean-reducing loss); it returned {shape} "
                f"for microbatch {j} on stage {state.index}"
            )
        self._losses.append(loss.detach())
        return loss

    def _pass_on(
        self, state: StageState, key: tuple[int, int, int], tensors: tuple[torch.Tensor, ...], forward: bool
    ) -> None:
        local = state.next_local if forward else state.prev_local
        if local:
            self._handoff[key] = tensors
        else:
            neighbour = state.index + 1 if forward else state.index - 1
            self.comm.send(key, self._placement.rank_of(neighbour), tensors)

    def _forward_failure(self, state: StageState, j: int, inputs: tuple, error: Exception) -> str:
        shapes = ", ".join(f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in inputs)
        where = (
            f"the forward of stage {state.index} ({state.name}, rank {self.rank}) failed on microbatch {j}"
        )
        cause = f"{type(error).__name__}: {error}"
        if state.first:
            return f"{where} with the batch inputs [{shapes}]: {cause}"
        previous = state.index - 1
        return (
            f"{where} with inputs [{shapes}] from stage {previous} "
            f"(rank {self._placement.rank_of(previous)}): "
            f"{cause} — check that the outputs of stage {previous} match what stage {state.index} expects"
        )


def _floating(tensors: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return [t for t in tensors if t.is_floating_point()]
