"""Runs one rank's program of a :class:`~zerobubble.schedule.Schedule` for one training step.

The program is compiled once into a list of ``(op or hook, handler, stage, microbatch)`` entries
(the ``handlers`` dispatch table, as in DeepSpeed's pipeline engine), so an op costs one call.
Runtime actions that are not ops of the schedule — the optimizer settle, the vocabulary embedding's
lookups — are :class:`Hook` entries of the same list (:meth:`Executor.add_hook`,
:meth:`Executor.add_start_hook`), and the lowered program's communication (a message's send and
receive, a chunk's all-reduce) are entries bound by a :class:`~.program.Communication`
(:mod:`.transfers`), so they survive a recompile and show in traces.  Each handler takes its inputs
from the mailbox, computes and leaves its outputs there, exposed separately so an emulation
(:mod:`.emulate`) can reuse them.  F keeps what B needs, B keeps only what the deferred W
needs (the stage's :class:`WeightGradStore`), W frees the rest.  Each forward draws from
its own RNG stream (:func:`forward_seed`); a failure is reported to the peers before it propagates.
While a torch profiler records, each entry runs in a ``record_function`` range (:mod:`..observe.ranges`);
otherwise the plain loop runs, with one check of the profiler per step.

The program's structure, the memory each op keeps and the RNG streams: ``docs/runtime.md``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.profiler import record_function
from torch.utils._pytree import tree_map

from ...schedule.channels import ACTIVATIONS, GRADIENTS, MessageKey
from ...schedule.ir import Kind, Op, Schedule
from ...schedule.lowering import Action, Compute
from .. import PipelineError
from ..failures import PeerFailure
from ..observe import ranges
from ..observe.recorder import Recorder
from ..tensors import is_dtensor
from ..wgrad import WeightGradStore
from ..wgrad.verify import SplitGuard
from .comm import Comm
from .ends import ModelEnds
from .pairs import OverlapHook, expand_pairs, fold_pairs, overlap_hook
from .program import (
    Communication,
    Hook,
    NoCommunication,
    ProgramEntry,
    checked_actions,
    comm_entries,
    forward_entries,
    plain_actions,
)
from .transfers import Mailbox, Transfers, forward_transfer, outgoing

_MISMATCH_WORDS = ("shape", "size", "dtype", "mat1", "mat2", "Expected", "expected", "must match")


class StageState:
    """One virtual stage held by this rank: its module, its W store and its in-flight microbatches."""

    __slots__ = ("first", "guard", "index", "last", "module", "name", "saved", "store")

    def __init__(
        self, index: int, module: nn.Module, store: WeightGradStore, first: bool, last: bool, name: str
    ):
        self.index, self.module, self.store, self.name = index, module, store, name
        self.first, self.last = first, last
        self.saved: dict[int, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {}
        self.guard: SplitGuard | None = None  # checks the split before F (.wgrad.verify), or None


class Executor:
    """Executes ``schedule.programs[rank]`` over this rank's ``stages`` (stage index → StageState).

    ``loss_fn(output, target)`` runs after the last stage; each microbatch's loss is scaled by
    ``loss_scale/m`` before its backward so the accumulated gradients are those of the mean loss
    (times ``loss_scale``).  ``seed`` is the root of the per-(step, stage, microbatch) RNG streams.
    """

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        stages: dict[int, StageState],
        comm: Comm,
        loss_fn: Callable,
        seed: int = 0,
        ends: ModelEnds | None = None,
    ):
        self.schedule = schedule
        self.ends = ends or ModelEnds()  # the work at the model's ends (.ends): the embedding, the head
        self.rank = rank
        self.stages = stages
        self.comm = comm
        self.loss_fn = loss_fn
        self.recorder: Recorder | None = None
        self._placement = schedule.placement
        # the messages produced and not yet taken (by the consumer, or by their send's entry)
        self._handoff: Mailbox = {}
        self._transfers = Transfers(comm, self._handoff, schedule.placement, rank)
        self._inputs: Sequence[tuple[torch.Tensor, ...]] = ()
        self._targets: Sequence[Any] = ()
        self._losses: list[torch.Tensor] = []
        self._kwargs: Sequence[Mapping[str, Any]] = ()  # per microbatch; () without keyword arguments
        self.loss_microbatches: list[int] = []  # the microbatch of each loss of the last run
        self.outputs: dict[int, Any] | None = None  # the last stage's outputs by microbatch, if kept
        self._scale = 1.0 / schedule.microbatches
        self.handlers: dict[Kind, Callable[[StageState, int], None]] = {
            Kind.F: self._forward,
            Kind.B: self._backward,
            Kind.BW: self._backward_fused,
            Kind.W: self.compute_weight,
        }
        self.handlers.update(self.ends.op_handlers())
        self.program: list[ProgramEntry] = []
        self._profiled: tuple[list[ProgramEntry], list[ProgramEntry]] | None = None  # (program, ranged)
        self._start: list[Hook] = []  # run before anything of a training step reads a parameter
        self._before: dict[int, list[Hook]] = {}
        self._after: dict[int, list[Hook]] = {}
        self._actions: tuple[Action, ...] = plain_actions(schedule, rank)  # or the lowered (follow)
        self.communication: Communication = NoCommunication()
        self._overlap: OverlapHook | None = None  # runs each overlapped F&B pair's halves (.pairs)
        self.compile()
        self._steps = 0
        self.seed = seed
        self._keep = True  # False in forward-only steps: nothing is kept for a backward
        self._reported = False
        self._cuda = comm.device.type == "cuda"  # F ops then save and restore the CUDA RNG too

    @property
    def overlap(self) -> OverlapHook | None:
        """How each overlapped F&B pair runs (:mod:`.pairs`): None in program order, or a hook."""
        return self._overlap

    @overlap.setter
    def overlap(self, overlap: OverlapHook | str | None) -> None:
        self._overlap = overlap_hook(overlap)  # "threads": a ThreadedOverlap, its worker made once

    def compile(self) -> None:
        """Bind every action of this rank's program to its handler and place the hooks around the ops.

        The program is the lowered one (:meth:`follow`; by default the schedule's own, without data
        parallelism); a compute op is one entry at its first part, a send's or receive's action one
        entry (:mod:`.transfers`), another communication action one where :attr:`communication`
        binds it (:mod:`.program`).  Call again after changing ``handlers``; the hooks are kept.
        """
        program: list[ProgramEntry] = [(hook, hook.run, None, 0) for hook in self._start]
        ends = self.ends
        if ends.works_each_step:  # it may read parameters (the embedding's rows): after the settle
            start = Hook(
                "model ends: step start",
                lambda: ends.begin_step(self._inputs, self._targets, self._scale, training=True),
            )
            program.append((start, start.run, None, 0))
        own_kinds, communication, position = ends.op_handlers(), self.communication, 0
        binders = (self._transfers, communication)
        for action in self._actions:
            if not isinstance(action, Compute):
                program += comm_entries(action, binders)
                continue
            if not action.first:  # the op ran whole at its first part
                continue
            op = action.op
            program += [(hook, hook.run, None, 0) for hook in self._before.get(position, ())]
            state = ends if op.kind in own_kinds else self.stages[op.stage]
            handler = communication.compute_handler(op, self.handlers[op.kind])
            program.append((op, handler, state, op.microbatch))
            program += [(hook, hook.run, None, 0) for hook in self._after.get(position, ())]
            position += 1
        # an overlapped F&B pair: one entry running both ops and the actions between (.pairs)
        self.program = fold_pairs(program, self)

    def follow(self, program: Sequence[Action]) -> None:
        """Run ``program``, this rank's lowered program of the schedule (``schedule/lowering``), from
        now on; its compute ops must be the schedule's (raises :class:`PipelineError`)."""
        self._actions = checked_actions(program, self.schedule, self.rank)
        self.compile()

    def communicate(self, communication: Communication) -> None:
        """Bind the lowered program's communication actions through ``communication`` (:mod:`.program`)."""
        self.communication = communication
        self.compile()

    def add_hook(self, position: int, hook: Hook, after: bool = False) -> None:
        """Run ``hook`` just before (or ``after``) the op at ``position`` of this rank's program."""
        if not 0 <= position < len(self.schedule.programs[self.rank]):
            raise PipelineError(f"no op at position {position} of rank {self.rank}'s program")
        (self._after if after else self._before).setdefault(position, []).append(hook)
        self.compile()

    def add_start_hook(self, hook: Hook) -> None:
        """Run ``hook`` at the start of every training step, before the step reads any parameter
        (the model's ends start the step after these hooks: the vocabulary embedding's lookups)."""
        self._start.append(hook)
        self.compile()

    def run_step(
        self,
        inputs: Sequence[tuple[torch.Tensor, ...]],
        targets: Sequence[Any],
        loss_scale: float = 1.0,
        *,
        kwargs: Sequence[Mapping[str, Any]] = (),
        keep_outputs: bool = False,
    ) -> list[torch.Tensor]:
        """Run the program once; ``inputs``/``targets`` are per-microbatch (empty where unused).

        Each microbatch's loss is multiplied by ``loss_scale / m`` before its backward.  Returns the
        detached (unscaled) per-microbatch losses on the rank of the last stage, else ``[]``, in the
        order they ran (their microbatches: :attr:`loss_microbatches`).  ``kwargs`` are the keyword
        arguments of every stage's forward, per microbatch (:func:`~..construct.staging.split_keywords`);
        ``keep_outputs`` keeps the last stage's detached outputs in :attr:`outputs`.
        """
        self._inputs, self._targets, self._losses = inputs, targets, []
        self._begin_call(kwargs, keep_outputs)
        self._scale = loss_scale / self.schedule.microbatches
        self._reported, entry = False, None
        try:
            self.comm.start_step(first=self._steps == 0)
            recorder = self.recorder
            if ranges.profiling():
                self._run_profiled(recorder)
            elif recorder is None:
                for entry in self.program:
                    entry[1](entry[2], entry[3])
            else:
                self._run_recorded(recorder, self.program)
            entry = None
            self._finish_step()
        except BaseException as error:
            self._report(error, entry[0] if entry is not None else None)
            self._abort()
            raise
        finally:
            self._inputs = self._targets = self._kwargs = ()
        self._steps += 1
        return self._losses

    def run_forward(
        self,
        inputs: Sequence[tuple[torch.Tensor, ...]],
        targets: Sequence[Any],
        *,
        kwargs: Sequence[Mapping[str, Any]] = (),
        keep_outputs: bool = False,
    ) -> list[torch.Tensor]:
        """Run only the forward ops of the program, keeping nothing for a backward (evaluation).

        The caller disables autograd and sets eval mode; the RNG streams are those of the next
        training step (dropout is off in eval mode anyway).  Returns the per-microbatch losses on
        the rank of the last stage, else ``[]``; ``kwargs`` and ``keep_outputs`` as for :meth:`run_step`.
        """
        self._inputs, self._targets, self._losses, self._keep = inputs, targets, [], False
        self._begin_call(kwargs, keep_outputs)
        self._reported, op = False, None
        ends = self.ends
        try:
            self.comm.start_step(first=True, forward_only=True)
            ends.begin_step(inputs, targets, 1.0 / self.schedule.microbatches, training=False)
            profiling, kinds = ranges.profiling(), {Kind.F, *ends.forward_kinds}
            entries = forward_entries(expand_pairs(self.program), kinds, forward_transfer)
            for op, handler, state, microbatch in entries:
                if profiling:
                    with record_function(_range_name(op)):
                        handler(state, microbatch)
                else:
                    handler(state, microbatch)
            op = None
            for j, loss in ends.forward_losses():  # the losses the ends computed on this rank
                self._record_loss(loss, j)
            self._finish_step()
        except BaseException as error:
            self._report(error, op)
            self._abort()
            raise
        finally:
            self._inputs = self._targets = self._kwargs = ()
            self._keep = True
        return self._losses

    def _finish_step(self) -> None:
        """The ends' and the channels' step end; every message produced was taken (else the program
        lacks a send or a consumer: raises)."""
        self.ends.finish_step()
        self.comm.finish_step()
        if self._handoff:
            raise PipelineError(
                f"rank {self.rank}: messages {list(self._handoff)[:4]} were produced but neither sent "
                "nor consumed this step — the program lacks their send: run the lowered program "
                "(Executor.follow(lowering.lower(schedule, ...).program_of(rank)))"
            )

    def _begin_call(self, kwargs: Sequence[Mapping[str, Any]], keep_outputs: bool) -> None:
        self._kwargs, self.loss_microbatches = kwargs, []
        self.outputs = {} if keep_outputs else None

    def _report(self, error: BaseException, op: Op | Hook | None) -> None:
        """Post this rank's failure to the peers (not when it only echoes a peer's)."""
        if isinstance(error, PeerFailure) or self._reported:
            return
        self._reported = True
        if isinstance(op, Hook):
            where = f"the {op.name}"
        else:
            where = f"op {op} (stage {op.stage}, microbatch {op.microbatch})" if op is not None else "a step"
        self.comm.monitor.post(f"rank {self.rank} failed in {where}: {type(error).__name__}: {error}")

    def _run_recorded(self, recorder: Recorder, program: list[ProgramEntry]) -> None:
        recorder.begin_step()
        clock, record, event = recorder.clock, recorder.op, recorder.event
        for op, handler, state, microbatch in program:
            started = clock()
            try:
                handler(state, microbatch)
            except BaseException as error:
                self._report(error, op)
                raise
            if state is None:  # a hook's entry (only hooks have no stage)
                event(op.name, started, clock())  # type: ignore[union-attr]
            else:
                record(op, started, clock())  # type: ignore[arg-type]

    def _run_profiled(self, recorder: Recorder | None) -> None:
        """The program with every entry in its profiler range, all in one ``zerobubble/step`` range."""
        program = self._ranged_program()
        with record_function(ranges.STEP):
            if recorder is not None:
                self._run_recorded(recorder, program)
                return
            for op, handler, state, microbatch in program:
                try:
                    handler(state, microbatch)
                except BaseException as error:
                    self._report(error, op)
                    raise

    def _ranged_program(self) -> list[ProgramEntry]:
        """``program`` with each handler wrapped in its range; rebuilt when the program changes."""
        cached = self._profiled
        if cached is not None and cached[0] is self.program:
            return cached[1]
        ranged: list[ProgramEntry] = []
        for op, handler, state, microbatch in self.program:
            ranged.append((op, _in_range(_range_name(op), handler), state, microbatch))
        self._profiled = (self.program, ranged)
        return ranged

    def _abort(self) -> None:
        self.comm.abort_step()
        self.ends.abort()
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
        """The inputs of F(state, j): the batch, or the message in the mailbox (a local hand-over
        or one received by its wait entry)."""
        return self._stage_inputs(state, j)

    def compute_forward(
        self, state: StageState, j: int, inputs: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]:
        """Run the stage's forward (and the loss on the last stage); keep what B needs; return the outputs."""
        kwargs = self._kwargs[j] if self._kwargs else _NO_KEYWORDS
        saved_rng = self._enter_stream(state.index, j)
        try:
            if self._keep:
                if state.guard is not None:  # the split proves itself on a new path first, with
                    state.guard.before_forward(inputs, kwargs)  # this forward's own RNG draws
                # B or BW of (stage, j) follows: the split may leave work for its end
                state.store.begin_forward((state.index, j))
            outputs = state.module(*inputs, **kwargs)
        except PipelineError:
            raise
        except Exception as error:
            raise PipelineError(self._forward_failure(state, j, inputs, error, kwargs)) from error
        finally:
            state.store.end_forward()
            self._leave_stream(saved_rng)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        if state.last and self.ends.takes_outputs:
            self.ends.take_outputs(j, outputs, state.index)
            if self.outputs is not None:
                self.outputs[j] = outputs[0].detach()
        elif state.last:
            outputs = (self._loss(state, outputs, j),)
        if self._keep:
            state.saved[j] = (inputs, outputs)
        return outputs

    def _enter_stream(self, stage: int, j: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Seed the RNG for F(stage, j) of this step; return the caller's state to restore."""
        saved = (torch.get_rng_state(), torch.cuda.get_rng_state() if self._cuda else None)
        seed = forward_seed(self.seed, self._steps, stage, j)
        # only the generators a forward here draws from: torch.manual_seed also visits every other
        # backend's generators and costs ~100 µs a call, per forward op
        torch.default_generator.manual_seed(seed)
        if self._cuda:
            torch.cuda.manual_seed(seed)  # the current device's generator
        return saved

    def _leave_stream(self, saved: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        torch.set_rng_state(saved[0])
        if saved[1] is not None:
            torch.cuda.set_rng_state(saved[1])

    def send_forward(self, state: StageState, j: int, outputs: tuple[torch.Tensor, ...]) -> None:
        """Leave F's outputs for the next stage in the mailbox (the last stage passes nothing); a
        send entry takes them to another rank."""
        if not state.last:
            self._handoff[MessageKey(ACTIVATIONS, state.index, j)] = outgoing(
                state.index, state.name, outputs
            )

    def receive_backward(self, state: StageState, j: int) -> tuple[torch.Tensor, ...] | None:
        """The gradient of the stage's outputs for microbatch ``j`` (None on the last stage: the loss)."""
        if state.last:
            if not self.ends.takes_outputs:
                return None
            grad, loss = self.ends.output_grads(j)
            self._record_loss(loss, j)
            return (grad.to(state.saved[j][1][0].dtype),)
        return self._take(MessageKey(GRADIENTS, state.index, j))

    def compute_backward(
        self, state: StageState, j: int, received: tuple[torch.Tensor, ...] | None, defer: bool
    ) -> tuple[torch.Tensor, ...]:
        """Backward of microbatch ``j`` (weight gradients deferred to W if ``defer``); the input gradients."""
        inputs, outputs = state.saved.pop(j)
        if received is None:
            loss = outputs[0] * self._scale
            tensors, grads = [loss], [torch.ones_like(loss)]
        else:
            pairs = [(out, grad) for out, grad in zip(_floating(outputs), received) if out.requires_grad]
            tensors, grads = [p[0] for p in pairs], [p[1] for p in pairs]
        state.store.begin((state.index, j), defer)
        try:
            if tensors:
                _run_backward(tensors, grads)
        finally:
            state.store.end()
        if state.first:
            self.ends.first_input_grads(j, inputs)
            return ()
        return tuple(x.grad if x.grad is not None else torch.zeros_like(x) for x in _floating(inputs))

    def send_backward(self, state: StageState, j: int, input_grads: tuple[torch.Tensor, ...]) -> None:
        """Leave B's input gradients for the previous stage in the mailbox (none from the first stage)."""
        if not state.first:
            self._handoff[MessageKey(GRADIENTS, state.index - 1, j)] = input_grads

    # -- helpers -----------------------------------------------------------------------------------

    def _stage_inputs(self, state: StageState, j: int) -> tuple[torch.Tensor, ...]:
        if state.first:
            return self.ends.first_inputs(j, self._inputs[j])
        received = self._take(MessageKey(ACTIVATIONS, state.index - 1, j))
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
        self._record_loss(loss, j)
        if self.outputs is not None:
            self.outputs[j] = tree_map(_detach_value, output)
        return loss

    def _record_loss(self, loss: torch.Tensor, j: int) -> None:
        self._losses.append(_own_storage(loss.detach()))
        self.loss_microbatches.append(j)

    def _take(self, key: MessageKey) -> tuple[torch.Tensor, ...]:
        """The tensors of message ``key``: handed over on this rank, or received by its wait entry."""
        try:
            return self._handoff.pop(key)
        except KeyError:
            raise PipelineError(
                f"rank {self.rank}: message {key} is needed but was neither handed over nor received "
                "— the program lacks its receive's wait before the consumer (run the lowered program)"
            ) from None

    def _forward_failure(
        self, state: StageState, j: int, inputs: tuple, error: Exception, kwargs: Mapping[str, Any]
    ) -> str:
        shapes = ", ".join(_describe(t) for t in inputs)
        if kwargs:
            shapes += "; keywords " + ", ".join(f"{key}={_describe(value)}" for key, value in kwargs.items())
        where = (
            f"the forward of stage {state.index} ({state.name}, rank {self.rank}) failed on microbatch {j}"
        )
        cause = f"{type(error).__name__}: {error}"
        if state.first:
            return f"{where} with the batch inputs [{shapes}]: {cause}"
        previous = state.index - 1
        source = f"stage {previous} (rank {self._placement.rank_of(previous)})"
        message = f"{where} with inputs [{shapes}] from {source}: {cause}"
        if any(word in str(error) for word in _MISMATCH_WORDS):  # only then is the hand-over suspect
            message += f" — check that the outputs of stage {previous} match what stage {state.index} expects"
        return message


def _range_name(op: Op | Hook) -> str:
    return ranges.hook_range(op.name) if isinstance(op, Hook) else ranges.op_range(op)


def _in_range(name: str, handler: Callable[[Any, int], None]) -> Callable[[Any, int], None]:
    """``handler`` run inside the profiler range ``name``."""

    def run(state: Any, microbatch: int) -> None:
        with record_function(name):
            handler(state, microbatch)

    return run


_engine_run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)


def _run_backward(tensors: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """``torch.autograd.backward(tensors, grads)`` without its argument checks (about 40 µs a call:
    ``docs/runtime.md``, "The backward call").

    The gradients are the next stage's input gradients of these very outputs (or ones for the
    loss), so their shapes and dtypes already match.  Through torch's own entry to the engine, which
    keeps what compiled code running on the engine's device threads reads; where a torch lacks it,
    the public call.
    """
    if _engine_run_backward is None:
        torch.autograd.backward(tensors, grads)
    else:
        _engine_run_backward(tuple(tensors), tuple(grads), False, False, (), True, True)


_NO_KEYWORDS: Mapping[str, Any] = {}


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{list(value.shape)} {str(value.dtype).replace('torch.', '')}"
    return type(value).__name__


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, copied when it is a view into a larger storage.

    Why: a reduced loss may be a 0-dim view into its elementwise buffer (CPU ``F.mse_loss`` keeps a
    whole microbatch-sized buffer alive behind its scalar); the losses returned from a step are
    kept for all of it, so on the rank of the last stage each would hold that buffer to the end.
    """
    if is_dtensor(tensor) or tensor.untyped_storage().nbytes() <= tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone()


def _detach_value(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _floating(tensors: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return [t for t in tensors if t.is_floating_point()]


def forward_seed(seed: int, step: int, stage: int, microbatch: int) -> int:
    """The RNG seed of F(stage, microbatch) in step ``step``: a hash of the four numbers (63 bits)."""
    digest = hashlib.blake2b(f"{seed}/{step}/{stage}/{microbatch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
