"""The vocabulary-parallel output layer and embedding at run time: one rank's shard and its collectives.

Every rank of the pipeline holds one slice of the vocabulary rows (:mod:`.layers`).  The
output layer runs as the schedule's S and T ops (:mod:`~zerobubble.schedule.vocab`):

* the last stage's F broadcasts its hidden states (``hidden`` group, in microbatch order);
* S(r, j) computes shard r's partials, then starts the one reduction of microbatch j: an all-gather
  of the per-token statistics (every rank needs the global max and sum for its T) and a gather of
  the input-gradient parts to the last stage's rank (``reduce`` group);
* the last stage's B(j) waits for both and gets the exact gradient of its output and the loss;
* T(r, j) waits for the statistics only and accumulates shard r's weight gradient.

The embedding needs no op of its own (a lookup costs nothing next to a layer): every rank looks up
its tokens at the start of a step and the sums are reduced to the first stage's rank, microbatch by
microbatch (``embed`` group); at the end of the step the first stage's input gradients are broadcast
and each rank accumulates its rows.  Each group sees its collectives in one order on every rank
(the validator checks the S order), so no collective can wait for another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ...schedule import Kind, Schedule
from .. import PipelineError
from ..execute.ends import ModelEnds
from ..parallel.consistency import broadcast_replicas
from ..parallel.data_parallel import GradientAverager
from ..parallel.groups import local_group
from .layers import (
    HeadTotals,
    VocabParallelEmbedding,
    VocabParallelHead,
    check_labels,
    check_tokens,
    embedding_partial,
    embedding_weight_grad,
    head_input_grad,
    head_partials,
    head_totals,
    head_weight_grad,
)

if TYPE_CHECKING:
    from ..parallel.data_parallel import ParallelLayout


@dataclass
class VocabGroups:
    """The process groups of the vocabulary collectives (each over every rank of the pipeline)."""

    hidden: Any
    reduce: Any
    embed: Any


@dataclass
class _Shard:
    """What S(r, j) leaves for T(r, j) and for the last stage's B(j)."""

    hidden: torch.Tensor
    logits: torch.Tensor
    stats: list[torch.Tensor]
    stats_work: Any
    parts: list[torch.Tensor] = field(default_factory=list)
    parts_work: Any = None
    sent: torch.Tensor | None = None  # this rank's parts, alive until the gather is over
    totals: HeadTotals | None = None
    uses: int = 1  # T, and on the last stage's rank also B


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class VocabRunner(ModelEnds):
    """The vocabulary-parallel head and embedding of one pipeline rank during a step: the model's
    ends (:class:`~..execute.ends.ModelEnds`) of a Pipeline with ``head=`` or ``embedding=``.

    ``rank`` is this rank's pipeline position; the pipeline's size, the ranks of the last and the
    first stage (``last``/``first``) and the microbatches are ``schedule``'s.  The executor drives it
    through the protocol: the
    S and T handlers, the step's start (the embedding's lookups) and end, the first stage's inputs
    (:meth:`embedded`) and their gradients (:meth:`embedding_grad`), the last stage's outputs
    (:meth:`hidden_ready`) and their gradient (:meth:`input_grad`).
    """

    works_each_step = True
    forward_kinds = frozenset({Kind.S})

    def __init__(
        self,
        *,
        head: VocabParallelHead | None,
        embedding: VocabParallelEmbedding | None,
        schedule: Schedule,
        rank: int,
        groups: VocabGroups,
        device: torch.device,
        wait: Callable[[Any, str], None] = lambda work, what: work.wait(),
        replicas: GradientAverager | None = None,
    ):
        self._wait = wait  # the peer monitor's: a dead or failed peer ends the wait with its error
        self.head, self.embedding = head, embedding
        self.rank, self.size = rank, schedule.num_ranks
        self.last = schedule.placement.rank_of(schedule.num_stages - 1)
        self.first = schedule.placement.rank_of(0)
        self.microbatches, self.groups, self.device = schedule.microbatches, groups, device
        self._labels: list[torch.Tensor] = []
        self._shapes: list[torch.Size] = []
        self._hidden: dict[int, tuple[torch.Tensor, Any]] = {}  # microbatch -> (buffer, broadcast work)
        self._shards: dict[int, _Shard] = {}
        self._tokens: list[torch.Tensor] = []
        self._embedded: list[tuple[torch.Tensor, Any]] = []
        self._embedding_grads: dict[int, torch.Tensor] = {}
        self._scale, self._training = 1.0, True
        self.takes_outputs = head is not None
        # data parallelism: the replicas' average of the weights' gradients (chunk 0 the head's,
        # started after this step's last T; chunk 1 the embedding's and a tied weight's, at the end)
        self._replicas, self._t_done = replicas, 0

    # -- the protocol (.ends) ------------------------------------------------------------------------

    def op_handlers(self) -> dict[Kind, Callable[[Any, int], None]]:
        """S and T, with a head."""
        return {Kind.S: self.forward_shard, Kind.T: self.weight_grad} if self.head is not None else {}

    def first_inputs(self, j: int, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """With an embedding, the summed embedding of the tokens (the batch's first input) and the rest."""
        return (self.embedded(j), *batch[1:]) if self.embedding is not None else batch

    def first_input_grads(self, j: int, inputs: tuple[torch.Tensor, ...]) -> None:
        """With an embedding, keep the gradient of its output for the step's end."""
        if self.embedding is not None:
            self.embedding_grad(j, inputs[0].grad)

    def take_outputs(self, j: int, outputs: tuple[torch.Tensor, ...], stage: int) -> None:
        """The last stage's hidden states go to the head's shards (their S ops, on every rank)."""
        if len(outputs) != 1:
            raise PipelineError(
                f"with a vocabulary-parallel head the last stage must return one tensor (the hidden "
                f"states); stage {stage} returned {len(outputs)} values"
            )
        self.hidden_ready(j, outputs[0])

    def output_grads(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage's B(j): :meth:`input_grad`."""
        return self.input_grad(j)

    # -- the step ------------------------------------------------------------------------------------

    def begin_step(
        self, inputs: Sequence[tuple[torch.Tensor, ...]], targets: Sequence[Any], scale: float, training: bool
    ) -> None:
        """Keep the step's labels and start the embedding's reductions; the labels and tokens were
        checked before the call ran (:func:`check_vocab_call`)."""
        self._scale, self._training, self._t_done = scale, training, 0
        if self.head is not None:
            labels = [torch.as_tensor(t).to(self.device).reshape(-1) for t in targets]
            self._labels, self._shapes = labels, [torch.as_tensor(t).shape for t in targets]
        if self.embedding is not None:
            self._tokens = [x[0] for x in inputs]
            self._embedded = []
            for tokens in self._tokens:
                part = embedding_partial(self.embedding, tokens, checked=True)
                work = dist.reduce(part, group_dst=self.first, group=self.groups.embed, async_op=True)
                self._embedded.append((part, work))

    def finish_step(self) -> None:
        """Finish the embedding's gradient (a broadcast from the first stage's rank) and every
        collective still in flight."""
        for j, (_, work) in self._hidden.items():
            if work is not None:
                self._wait(work, f"the broadcast of microbatch {j}'s last hidden states")
        self._hidden.clear()
        for j, shard in self._shards.items():  # forward-only steps leave their statistics here
            self._wait_parts(shard, j)
            self._wait(shard.stats_work, f"the vocabulary statistics of microbatch {j}")
        self._shards.clear()
        if self.embedding is not None:
            for j, (_, work) in enumerate(self._embedded):
                if work is not None:
                    self._wait(work, f"the embedding's reduction of microbatch {j}")
            self._embedded = []
            if self._training:
                self._embedding_backward()
        if self._replicas is not None and self._training:
            if 1 in self._replicas.buckets:
                self._replicas.start(1)
            self._replicas.finish()

    def abort(self) -> None:
        """Drop everything of a failed step (its collectives are abandoned with the step)."""
        self._hidden.clear()
        self._shards.clear()
        self._embedded, self._embedding_grads = [], {}
        if self._replicas is not None:
            self._replicas.discard()

    def held_tensors(self) -> list[torch.Tensor]:
        """Every activation this rank's shard keeps now (for :class:`~..observe.memory.ActivationMeter`)."""
        held = [buffer for buffer, _ in self._hidden.values()]
        for shard in self._shards.values():
            held += [shard.hidden, shard.logits, *shard.stats, *shard.parts]
            held += [shard.sent] if shard.sent is not None else []
        held += [part for part, _ in self._embedded] + list(self._embedding_grads.values())
        return held

    # -- the output layer ----------------------------------------------------------------------------

    def hidden_ready(self, j: int, hidden: torch.Tensor) -> None:
        """The last stage's F(j) is done: broadcast its hidden states to every shard."""
        head = self._head()
        if hidden.shape[-1] != head.dim or hidden.shape[:-1] != self._shapes[j]:
            raise PipelineError(
                f"the last stage's output for microbatch {j} has shape {list(hidden.shape)}, but the "
                f"vocabulary-parallel head needs the targets' shape {list(self._shapes[j])} followed by "
                f"its width {head.dim}"
            )
        flat = hidden.detach().reshape(-1, head.dim).to(head.weight.dtype).contiguous()
        work = dist.broadcast(flat, group_src=self.last, group=self.groups.hidden, async_op=True)
        self._hidden[j] = (flat, work)

    def _post_hidden(self, j: int) -> None:
        if j < self.microbatches and j not in self._hidden and self.rank != self.last:
            head = self._head()
            buffer = torch.empty(
                self._labels[j].numel(), head.dim, dtype=head.weight.dtype, device=self.device
            )
            work = dist.broadcast(buffer, group_src=self.last, group=self.groups.hidden, async_op=True)
            self._hidden[j] = (buffer, work)

    def forward_shard(self, _: Any, j: int) -> None:
        """S(r, j): this shard's partials of microbatch ``j``; start its one reduction."""
        head = self._head()
        self._post_hidden(j)
        hidden, work = self._hidden.pop(j)
        if work is not None and self.rank != self.last:
            self._wait(work, f"microbatch {j}'s last hidden states")
        elif work is not None:  # the sender keeps the tensor until its broadcast is over (T waits)
            self._hidden[j] = (hidden, work)
        self._post_hidden(j + 1)  # the next microbatch's hidden states travel meanwhile
        partials = head_partials(head, hidden, self._labels[j], checked=True)
        stats = [torch.empty_like(partials.stats) for _ in range(self.size)]
        stats_work = dist.all_gather(stats, partials.stats, group=self.groups.reduce, async_op=True)
        shard = _Shard(hidden, partials.logits, stats, stats_work, uses=1 + (self.rank == self.last))
        if self._training:
            gathered = (
                [torch.empty_like(partials.parts) for _ in range(self.size)]
                if self.rank == self.last
                else None
            )
            shard.parts_work = dist.gather(
                partials.parts, gathered, group_dst=self.last, group=self.groups.reduce, async_op=True
            )
            shard.parts, shard.sent = gathered or [], partials.parts
        self._shards[j] = shard

    def _totals(self, j: int) -> HeadTotals:
        shard = self._shards[j]
        if shard.totals is None:
            self._wait(shard.stats_work, f"the vocabulary statistics of microbatch {j}")
            head = self._head()
            shard.totals = head_totals(
                torch.stack(shard.stats), self._labels[j], ignore_index=head.ignore_index
            )
        return shard.totals

    def weight_grad(self, _: Any, j: int) -> None:
        """T(r, j): accumulate this shard's weight gradient of microbatch ``j``."""
        head = self._head()
        shard = self._shards[j]
        totals = self._totals(j)
        grad = head_weight_grad(head, shard.logits, shard.hidden, self._labels[j], totals, scale=self._scale)
        _accumulate(head.weight, grad)
        if self.rank != self.last:
            self._wait_parts(shard, j)
        shard.logits = torch.empty(0)
        self._release(j)
        self._t_done += 1
        if self._t_done == self.microbatches and self._replicas is not None and 0 in self._replicas.buckets:
            self._replicas.start(0)  # the head's gradient is final: its average travels meanwhile

    def input_grad(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage's B(j): the gradient of its output and the loss of microbatch ``j``."""
        shard = self._shards[j]
        totals = self._totals(j)
        self._wait_parts(shard, j)
        grad = head_input_grad(torch.stack(shard.stats), torch.stack(shard.parts), totals, scale=self._scale)
        self._release(j)
        return grad.reshape(*self._shapes[j], grad.shape[-1]), totals.loss

    def forward_losses(self) -> list[tuple[int, torch.Tensor]]:
        """After a forward-only step: every microbatch's loss on the last stage's rank, else none."""
        if self.head is None or self.rank != self.last:
            return []
        return [(j, self._totals(j).loss) for j in sorted(self._shards)]

    def _wait_parts(self, shard: _Shard, j: int) -> None:
        if shard.parts_work is not None:
            self._wait(shard.parts_work, f"the input-gradient parts of microbatch {j}")
            shard.parts_work, shard.sent = None, None

    def _release(self, j: int) -> None:
        shard = self._shards[j]
        shard.uses -= 1
        if shard.uses == 0:
            del self._shards[j]
            entry = self._hidden.pop(j, None)
            if entry is not None and entry[1] is not None:
                self._wait(entry[1], f"the broadcast of microbatch {j}'s last hidden states")

    def whole_on_replicas(self) -> list[torch.Tensor]:
        """The vocabulary rows this rank holds: whole on every replica, averaged at the step's end."""
        layers = [layer for layer in (self.embedding, self.head) if layer is not None]
        return list({id(layer.weight): layer.weight for layer in layers}.values())

    def _head(self) -> VocabParallelHead:
        if self.head is None:  # pragma: no cover - the schedule has S/T ops only with a head
            raise PipelineError("this pipeline has no vocabulary-parallel head")
        return self.head

    # -- the embedding -------------------------------------------------------------------------------

    def embedded(self, j: int) -> torch.Tensor:
        """The first stage's input of microbatch ``j``: the summed embedding, a leaf needing grad."""
        part, work = self._embedded[j]
        self._wait(work, f"the embedding's reduction of microbatch {j}")
        self._embedded[j] = (part, None)
        return part.detach().requires_grad_()

    def embedding_grad(self, j: int, grad: torch.Tensor | None) -> None:
        """The first stage's B(j) produced the gradient of its input: keep it for the step's end."""
        self._embedding_grads[j] = grad if grad is not None else torch.zeros_like(self._embedded[j][0])

    def _embedding_backward(self) -> None:
        embedding = self.embedding
        assert embedding is not None
        sizes = [t.numel() for t in self._tokens]
        if self.rank == self.first:
            flat = [self._embedding_grads[j].reshape(-1, embedding.dim) for j in range(self.microbatches)]
            grads = torch.cat(flat).to(embedding.weight.dtype).contiguous()
        else:
            grads = torch.empty(sum(sizes), embedding.dim, dtype=embedding.weight.dtype, device=self.device)
        work = dist.broadcast(grads, group_src=self.first, group=self.groups.embed, async_op=True)
        self._wait(work, "the broadcast of the first stage's input gradients")
        tokens = torch.cat([t.reshape(-1) for t in self._tokens])
        _accumulate(embedding.weight, embedding_weight_grad(embedding, tokens, grads))
        self._embedding_grads = {}


def check_vocab_request(
    head: Any,
    embedding: Any,
    *,
    loss_fn: Any,
    data_parallel: Any,
    mesh: Any,
    schedule: Any,
    parallelize: Any = None,
) -> None:
    """Refuse what the vocabulary-parallel layers do not support, the same way on every rank."""
    if head is not None and not isinstance(head, VocabParallelHead):
        raise PipelineError(f"head= takes a zerobubble.VocabParallelHead, not {type(head).__name__}")
    if embedding is not None and not isinstance(embedding, VocabParallelEmbedding):
        raise PipelineError(
            f"embedding= takes a zerobubble.VocabParallelEmbedding, not {type(embedding).__name__}"
        )
    if head is None and embedding is None:
        return
    if head is not None and loss_fn is not None:
        raise PipelineError(
            "head= computes the loss (the exact cross-entropy over the whole vocabulary): drop loss_fn="
        )
    if data_parallel == "hsdp" or parallelize is not None:
        what = 'data_parallel="hsdp"' if data_parallel == "hsdp" else "parallelize= (tensor parallelism)"
        raise PipelineError(
            f"the vocabulary-parallel head and embedding shard over each replica's pipeline ranks: they "
            f'combine with data_parallel= (a replica count, "replicate" or "fsdp") but not with {what}'
        )
    if head is None and schedule == "auto":
        raise PipelineError(
            'schedule="auto" with embedding= needs head= too: it chooses between a plain and a '
            "vocabulary-parallel output layer (docs/guide.md, Vocabulary parallelism)"
        )


def check_vocab_grid(head: Any, embedding: Any, grid: Any) -> None:
    """Refuse a device grid with ranks inside a stage (a mesh dimension besides the pipeline's and
    the data-parallel ones) for the vocabulary-parallel layers: the same on every rank, before any
    group is made."""
    if (head is not None or embedding is not None) and grid.tp > 1:
        raise PipelineError(
            f"the vocabulary-parallel head and embedding shard over each replica's pipeline ranks: the "
            f"mesh puts {grid.tp} ranks inside each stage ({grid.describe()}), which they do not "
            "support; keep only the pipeline and data-parallel dimensions"
        )


def place_vocab(
    head: VocabParallelHead | None,
    embedding: VocabParallelEmbedding | None,
    schedule: Schedule,
    layout: ParallelLayout,
    module: nn.Module,
    device: torch.device,
    wait: Callable[[Any, str], None],
) -> tuple[VocabRunner, list[str]]:
    """Keep this pipeline rank's vocabulary rows, register the layers in ``module`` as
    ``vocab_head`` and ``vocab_embedding``, and make their runner (collective: three local groups
    over the global ranks of ``layout``'s pipeline, this rank's replica).  Returns the runner and the
    layers' state-dict keys."""
    grid = layout.grid
    rank, ranks = grid.pipeline_rank, grid.replica_ranks(grid.dp_index)
    shard_vocab_layers(head, embedding, rank, len(ranks), device)
    keys = []
    for name, layer in (("vocab_embedding", embedding), ("vocab_head", head)):  # the embedding's name first
        if layer is not None:
            module.add_module(name, layer)
            keys.append(f"{name}.weight")
    groups = VocabGroups(*(local_group(ranks, timeout=layout.setup_timeout) for _ in range(3)))
    runner = VocabRunner(
        head=head, embedding=embedding, schedule=schedule, rank=rank, groups=groups, device=device,
        wait=wait, replicas=_replica_averager(head, embedding, layout, wait),
    )  # fmt: skip
    return runner, keys


def _replica_averager(
    head: VocabParallelHead | None,
    embedding: VocabParallelEmbedding | None,
    layout: ParallelLayout,
    wait: Callable[[Any, str], None],
) -> GradientAverager | None:
    """With replicas (data parallelism, or the ``ep`` ranks of expert parallelism), replica 0's rows
    copied to every replica and the averager of the rows' gradients over the replicas (collective
    over the group of this rank's column of replicas); None with one replica.

    The rows stay whole on every replica under ``data_parallel="fsdp"`` too, averaged like a
    replicated parameter's: FSDP2 reduce-scatters in autograd's post-backward hooks, and the shards'
    gradients are made by hand (S, T, the embedding's end of step), outside autograd; a shard's
    rows are already ``1/pp`` of the weight (docs/guide.md, "Vocabulary parallelism")."""
    grid = layout.grid
    if grid.replicas == 1:
        return None
    layers = nn.ModuleList([layer for layer in (embedding, head) if layer is not None])
    broadcast_replicas(layers, layout.dp_group, grid.global_rank(grid.pipeline_rank, 0))
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    chunks = {}
    if head is not None and not tied:
        chunks[0] = [[head.weight]]
    if embedding is not None:
        chunks[1] = [[embedding.weight]]  # a tied weight's gradient is final after the embedding's end
    return GradientAverager(chunks, layout.dp_group, grid.replicas, wait=wait)


def check_vocab_call(
    head: VocabParallelHead | None,
    embedding: VocabParallelEmbedding | None,
    inputs: Sequence[tuple[torch.Tensor, ...]],
    targets: Sequence[Any],
) -> None:
    """A call's labels and tokens, checked before anything runs: every rank holds them all, so a bad
    one raises the same :class:`PipelineError` on every rank and the Pipeline stays usable."""
    if head is not None:
        labels = torch.cat([torch.as_tensor(t).reshape(-1) for t in targets])
        check_labels(labels, head.vocab_size, head.ignore_index)
    if embedding is not None:
        check_tokens(torch.cat([x[0].reshape(-1) for x in inputs]), embedding.vocab_size)


def shard_vocab_layers(
    head: VocabParallelHead | None,
    embedding: VocabParallelEmbedding | None,
    rank: int,
    size: int,
    device: torch.device,
) -> None:
    """Keep this rank's vocabulary rows of ``head`` and ``embedding`` on ``device``; a head tied to
    the embedding (the same Parameter) stays tied to the embedding's shard."""
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    if embedding is not None:
        embedding.keep_shard(rank, size)
        embedding.to(device)
    if head is not None:
        if tied:
            assert embedding is not None
            head.share_shard(embedding)
        else:
            head.keep_shard(rank, size)
        head.to(device)


class _EmbeddingLayer(nn.Module):
    """A vocabulary-parallel embedding (unsharded) as the first layer of the plain model: it embeds
    the first input and passes the others on, as the Pipeline does before its first stage."""

    def __init__(self, embedding: VocabParallelEmbedding):
        super().__init__()
        self.embedding = embedding

    def forward(self, tokens: torch.Tensor, *rest: Any) -> Any:
        hidden = self.embedding(tokens)
        return (hidden, *rest) if rest else hidden


class _HeadLayer(nn.Module):
    """A vocabulary-parallel head (unsharded) as the last layer of the plain model: the logits."""

    def __init__(self, head: VocabParallelHead):
        super().__init__()
        self.head = head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # through the head's forward, which the weight-gradient split wraps: its W is deferred
        return self.head(hidden)


def plain_model(
    head: VocabParallelHead,
    embedding: VocabParallelEmbedding | None,
    layers: nn.Sequential | Sequence[nn.Module],
) -> tuple[list[nn.Module], Any]:
    """The same model with a plain head (and embedding) on the last (first) stage, and its loss: what
    ``schedule="auto"`` profiles and runs when the plan prefers it (the same Parameters)."""
    ignore_index = head.ignore_index

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=ignore_index)

    first = [_EmbeddingLayer(embedding)] if embedding is not None else []
    return [*first, *list(layers), _HeadLayer(head)], loss
