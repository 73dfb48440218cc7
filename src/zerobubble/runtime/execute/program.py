"""The entries of an executor's program: ops, runtime hooks and a lowered program's communication.

An executor runs a bare list of ``(op or hook, handler, stage state or None, microbatch)`` entries:
the lowered program of its rank (``schedule/lowering``).  Each compute op (its first part; an op
cut into FSDP units or buckets is one handler call, FSDP2's own per-module hooks gathering the units
inside) is an op entry, and each ``Issue``/``Wait`` that a :class:`Communication` binds is a
:class:`CommAction` entry: the sends and receives (:class:`~.transfers.Transfers`), the
data-parallel all-reduces, FSDP's unshards and reduce-scatters.  What nobody binds is left out when
the program is compiled — the output layer's collectives (:mod:`.ends`), the optimizer ``Step``
(``optimizer_step``) — so it costs nothing per op.  ``docs/communication.md``, "What the executor
runs", lists every action's entry.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

from ...schedule.ir import Kind, Op, Schedule
from ...schedule.lowering import Action, Issue, Wait, lower
from ...schedule.lowering.lower import compute_ops
from .. import PipelineError

Handler = Callable[[Any, int], None]


class Hook:
    """A named runtime action run at a fixed point of a rank's program; not an op of the schedule.

    It occupies its own program entry (``handler(state, microbatch)`` ignores both arguments), so
    the plain loop runs it like an op and a recorder sees it as an ``event`` named :attr:`name`.
    """

    __slots__ = ("action", "name")

    def __init__(self, name: str, action: Callable[[], None]):
        self.name = name
        self.action = action

    def run(self, state: Any, microbatch: int) -> None:
        """Run the action (the program-entry calling convention)."""
        self.action()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class CommAction(Hook):
    """The entry of a lowered ``Issue`` or ``Wait``, named as the action (``issue all_reduce(bucket 1.0)``,
    :data:`~..observe.recorder.COMM_ACTION_PREFIXES`); a recorder sees it as an event, which a trace
    draws in the rank's communication lane.  :attr:`lowered` is the action."""

    __slots__ = ("lowered",)

    def __init__(self, lowered: Issue | Wait, action: Callable[[], None]):
        super().__init__(str(lowered), action)
        self.lowered = lowered


ProgramEntry = tuple[Op | Hook, Handler, Any, int]
"""``(op or hook, handler, stage state or None, microbatch)``: one step of the compiled program."""


class Communication(Protocol):
    """What binds a lowered program's communication to work (implemented by
    :class:`~.transfers.Transfers`, :class:`~..parallel.data_parallel.GradientAverager` and
    :class:`~..parallel.fsdp.ShardedStages`)."""

    def comm_handler(self, action: Issue | Wait) -> Callable[[], None] | None:
        """The work of ``action`` on this rank, or None when it has none (left out of the program)."""
        ...

    def compute_handler(self, op: Op, handler: Handler) -> Handler:
        """The handler to run for ``op`` (``handler``, or it wrapped in work the op's parts need)."""
        ...


class NoCommunication:
    """No data-parallel communication: every communication action is left out."""

    def comm_handler(self, action: Issue | Wait) -> Callable[[], None] | None:
        """None: nothing to run."""
        return None

    def compute_handler(self, op: Op, handler: Handler) -> Handler:
        """``handler`` itself."""
        return handler


def plain_actions(schedule: Schedule, rank: int) -> tuple[Action, ...]:
    """``rank``'s program of ``schedule`` lowered without data parallelism: its ops, each in one
    part, and its sends and receives."""
    return lower(schedule).program_of(rank)


def checked_actions(program: Sequence[Action], schedule: Schedule, rank: int) -> tuple[Action, ...]:
    """``program`` if its compute ops are ``schedule``'s program of ``rank`` (raises PipelineError)."""
    if compute_ops(tuple(program)) != list(schedule.programs[rank]):
        raise PipelineError(
            f"the lowered program of rank {rank} runs other compute ops than the schedule "
            f"{schedule.name!r}: lower the schedule the executor runs (lowering.lower(schedule, ...))"
        )
    return tuple(program)


def comm_entries(action: Action, binders: Sequence[Communication]) -> list[ProgramEntry]:
    """The entry of a non-compute ``action``, bound by the first of ``binders`` that binds it — none
    when no one does (the optimizer ``Step`` never: it is the caller's ``optimizer_step``)."""
    if not isinstance(action, (Issue, Wait)):
        return []
    for binder in binders:
        work = binder.comm_handler(action)
        if work is not None:
            entry = CommAction(action, work)
            return [(entry, entry.run, None, 0)]
    return []


def forward_entries(
    program: Sequence[ProgramEntry], kinds: Collection[Kind], transfer: Callable[[Issue | Wait], bool]
) -> list[ProgramEntry]:
    """The entries of ``program`` a forward-only step runs: the ops of ``kinds`` and the
    communication actions ``transfer`` accepts (the activations' sends and receives); no hook."""
    return [
        entry
        for entry in program
        if (isinstance(entry[0], Op) and entry[0].kind in kinds)
        or (isinstance(entry[0], CommAction) and transfer(entry[0].lowered))
    ]
