"""The per-stage store of deferred weight-gradient work, and how W adds into ``.grad``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, TypeVar

import torch

from ..tensors import tensors_in

Work = TypeVar("Work", bound=Callable[[], None])
top_saved_tensor_hooks = torch._C._autograd._top_saved_tensors_default_hooks
"""``top_saved_tensor_hooks(False)``: the innermost saved-tensor hooks' ``(pack, unpack)``, or None."""


class WeightGradStore:
    """Deferred weight-gradient work of one stage, keyed by ``(stage, microbatch)``.

    Between :meth:`begin` and :meth:`end` (one B op) every split layer's backward either hands a
    closure computing its weight gradients to :meth:`put` (``defer=True``, a B op) or runs that same
    work at once (``defer=False``, a fused BW op).  :meth:`flush` (the W op)
    runs the closures of one key, last queued first, and drops them — with them the tensors they
    held.  One store belongs to one stage object, never to the process.
    """

    def __init__(self) -> None:
        self._pending: dict[tuple[int, int], list[Callable[[], None]]] = {}
        self._shared: dict[tuple[int, int], dict[Callable[[], Any], Any]] = {}
        self._key: tuple[int, int] | None = None
        self._run_at_end: list[Callable[[], None]] = []  # a fused backward's after-backward work
        self._queue: list[Callable[[], None]] | None = None  # the current key's W work in a B
        self._scope = _LocalScope()
        self._keepers: dict[torch.device, torch.Tensor] = {}
        self._forward_key: tuple[int, int] | None = None
        self._after_backward: dict[tuple[int, int], list[Callable[[], None]]] = {}
        self._parameters: list[torch.Tensor] = []  # the stage's, whose hooks run as in plain autograd
        self._held: HeldHooks | None = None  # the hooked parameters of the backward or W running now

    def track(self, parameters: Iterable[torch.Tensor]) -> None:
        """Make the hooks of ``parameters`` (the stage's) fire as a plain backward fires them.

        A plain per-microbatch backward runs a parameter's ``register_hook`` hooks once, on the
        microbatch's whole gradient, then adds it into ``.grad``, then runs its
        ``register_post_accumulate_grad_hook`` hooks.  The split reaches a parameter in pieces
        (a tied weight through two routed calls, a B part and a W part): during every B, fused BW
        and W the store holds such a parameter's hooks back and its ``.grad`` aside, gathers the
        pieces, and hands the sum to the hooks once — in W (or at a fused BW's end), never in B.
        """
        known = {id(p) for p in self._parameters}
        for param in parameters:
            if id(param) not in known:
                known.add(id(param))
                self._parameters.append(param)

    def tracked(self) -> list[torch.Tensor]:
        """The parameters :meth:`track` was given (the stage's), in order."""
        return list(self._parameters)

    def discard(self, key: tuple[int, int]) -> None:
        """Drop whatever ``key`` still has queued (W work, after-backward work) without running it."""
        self._pending.pop(key, None)
        self._shared.pop(key, None)
        self._after_backward.pop(key, None)

    def _hold_hooks(self) -> HeldHooks | None:
        params = self._parameters
        hooked = [p for p in params if p._backward_hooks or p._post_accumulate_grad_hooks]
        return HeldHooks(hooked) if hooked else None

    def keeper(self, device: torch.device) -> torch.Tensor:
        """An empty tensor requiring grad on ``device``, never given a gradient.

        A split node takes it as an extra input when nothing else it takes requires grad (a first
        stage), so that its output requires grad and B reaches it — an edge to a parameter would
        do that too, but B would then run the parameter's hooks with no gradient.
        """
        keeper = self._keepers.get(device)
        if keeper is None:
            keeper = self._keepers[device] = torch.empty(0, device=device, requires_grad=True)
        return keeper

    def keepers(self) -> list[torch.Tensor]:
        """Every keeper :meth:`keeper` has made (one a device)."""
        return list(self._keepers.values())

    @property
    def deferring(self) -> bool:
        """Whether the backward running now defers weight gradients to W (:meth:`put` then queues)."""
        return self._queue is not None

    def local_scope(self) -> _LocalScope:
        """A ``with`` block in which a generic module builds its local graph (or runs its forward
        on the stage's graph): modules nested in it run as they are (:attr:`in_local_scope`), since
        the outer module's graph collects their parameters.  Reentrant; one object per store."""
        return self._scope

    @property
    def in_local_scope(self) -> bool:
        """Whether a :meth:`local_scope` block is running."""
        return self._scope.depth > 0

    def begin_forward(self, key: tuple[int, int]) -> None:
        """Start the forward of ``key``, whose backward (B or a fused BW) will follow.

        Until :meth:`end_forward`, :meth:`after_backward` takes work for that backward: the
        executor's forwards do this; a forward without it (called directly) leaves the fast
        paths to hook autograd's nodes instead.
        """
        self._forward_key = key

    def end_forward(self) -> None:
        """Finish the forward started by :meth:`begin_forward`."""
        self._forward_key = None

    @contextmanager
    def keyed_forward(self, key: tuple[int, int]) -> Iterator[None]:
        """:meth:`begin_forward` ``key`` for the ``with`` block, :meth:`end_forward` after it."""
        self.begin_forward(key)
        try:
            yield
        finally:
            self.end_forward()

    def after_backward(self, work: Callable[[], None]) -> bool:
        """Queue ``work`` to run once the running forward's backward has run — in W when it is a
        B, at its end when it is a fused BW; False (nothing queued) outside :meth:`begin_forward`.

        For work that needs no hook inside the backward: a norm's alias parameters get their
        gradients from autograd's own accumulation, which W then reads (a hook on the norm's node
        costs B an engine call into Python per layer: ``docs/wgrad.md``).
        """
        if self._forward_key is None:
            return False
        self._after_backward.setdefault(self._forward_key, []).append(work)
        return True

    def begin(self, key: tuple[int, int], defer: bool) -> None:
        """Start the backward of ``key``; ``defer`` says whether weight gradients wait for W."""
        self._key = key
        self._queue = self._pending.setdefault(key, []) if defer else None
        self._held = self._hold_hooks()
        after = self._after_backward.pop(key, None)
        if after:
            if self._queue is None:
                self._run_at_end = after
            else:  # W runs its queue last first: these after everything B queues
                self._queue.extend(after)

    def end(self) -> None:
        """Finish the backward started by :meth:`begin` (a fused one: run its after-backward work)."""
        queue, held = self._queue, self._held
        self._held = None
        at_end, self._run_at_end = self._run_at_end, []
        try:
            if at_end:
                with torch.no_grad():
                    for work in at_end:
                        work()
        finally:
            if held is not None:
                gathered = held.release()
                if queue is not None:  # a B: what reached .grad in it waits for W, as the rest
                    if gathered:
                        queue.append(partial(_add_held, gathered))
                else:
                    with torch.no_grad():
                        _add_held(gathered)
        if self._key is not None and not self._pending.get(self._key, True):
            del self._pending[self._key]  # nothing was deferred
        self._key = None
        self._queue = None

    def put(self, work: Callable[[], None]) -> None:
        """Queue ``work`` (adds weight gradients into ``.grad`` when called) for the current key's W.

        Only while :attr:`deferring`; a split layer's backward otherwise runs the work at once.
        """
        queue = self._queue
        if queue is None:
            raise RuntimeError("WeightGradStore.put outside a deferring backward (check store.deferring)")
        queue.append(work)

    def shared(self, kind: Callable[[], Work]) -> Work:
        """The one ``kind()`` work item of the current key, created and queued on first use.

        Lets many layers pool their W work into one call (the generic split runs one autograd
        call per W op instead of one per layer).
        """
        if self._key is None or self._queue is None:
            raise RuntimeError("WeightGradStore.shared outside begin()/end(): no backward is deferring")
        per_key = self._shared.setdefault(self._key, {})
        work = per_key.get(kind)
        if work is None:
            work = per_key[kind] = kind()
            self.put(work)
        return work

    def flush(self, key: tuple[int, int]) -> None:
        """Run the W op of ``key``: accumulate every deferred weight gradient into ``.grad``.

        A key without deferred work (a stage without parameters) is a no-op.
        """
        # no_grad: saved inputs may require grad; a W op must not build a graph into .grad
        self._shared.pop(key, None)
        pending = self._pending.pop(key, ())
        if not pending:
            return
        held = self._hold_hooks()
        with torch.no_grad():
            try:
                # B queued the stage's layers last to first; W takes them first to last, starting with
                # the tensors B touched last, still in the caches (4 % of a GPT block's backward at 32
                # rows on CPU, neutral elsewhere: benchmarks/wgrad_overhead.py)
                for work in reversed(pending):
                    work()
            finally:
                if held is not None:
                    _add_held(held.release())

    def held_tensors(self, key: tuple[int, int] | None = None) -> list[torch.Tensor]:
        """The tensors the deferred work of ``key`` (every key when None) holds on to until W.

        What a W op will free, for memory meters and the profiler: the work items' bound arguments
        and attributes, searched a few levels deep.  Tensors an autograd graph keeps internally (the
        generic split's local graph) are not reachable from Python; saved-tensor hooks see those.
        """
        keys = list(self._pending) if key is None else [key]
        return tensors_in([self._pending.get(each, []) for each in keys], depth=6)

    def pending_keys(self) -> list[tuple[int, int]]:
        """Keys whose W (or whose backward, for a forward's after-backward work) has not run yet:
        empty after a complete step."""
        return list(self._pending) + [key for key in self._after_backward if key not in self._pending]

    def clear(self) -> None:
        """Drop every deferred entry (after a failed step); held hooks and ``.grad`` are put back."""
        if self._held is not None:
            self._held.release()
            self._held = None
        self._pending.clear()
        self._shared.clear()
        self._after_backward.clear()
        self._forward_key = None
        self._run_at_end = []
        self.end()


_OUTPUT_VIEWS = frozenset(("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"))


def computing_node(out: torch.Tensor) -> Any:
    """The node that computed ``out``, past the views its kernel returns (``F.linear`` on a 3-D
    input is an ``addmm`` and a view of its result), or None without one.

    A hook belongs there, not on the view's node: an in-place op on the output (``out.mul_(2)``,
    ``F.relu(out, inplace=True)``) rebases a view's history and drops its node from the graph, so a
    hook on it would never run and the layer's weight gradient would silently be lost.
    """
    node = out.grad_fn
    while node is not None and type(node).__name__ in _OUTPUT_VIEWS:
        edges = node.next_functions
        if len(edges) != 1 or edges[0][0] is None:
            break
        node = edges[0][0]
    return node


class _LocalScope:
    """The depth of nested local scopes (:meth:`WeightGradStore.local_scope`): a plain counter
    with ``with`` support, cheaper per call than a generator-based context manager."""

    __slots__ = ("depth",)

    def __init__(self) -> None:
        self.depth = 0

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1


class HeldHooks:
    """Parameters whose hooks are held back: their hook dicts emptied in place (autograd's C++ side
    reads the same dicts), their ``.grad`` set aside; :meth:`release` puts both back."""

    __slots__ = ("entries",)

    def __init__(self, params: list[torch.Tensor]):
        self.entries = []
        for param in params:
            pre, post = param._backward_hooks, param._post_accumulate_grad_hooks
            self.entries.append((param, param.grad, _emptied(pre), _emptied(post)))
            param.grad = None

    def release(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Restore every hook and ``.grad``; returns ``(parameter, gradient gathered meanwhile)``."""
        gathered = []
        for param, grad, pre, post in self.entries:
            piece = param.grad
            param.grad = grad
            _refill(param._backward_hooks, pre)
            _refill(param._post_accumulate_grad_hooks, post)
            if piece is not None:
                gathered.append((param, piece))
        self.entries = []
        return gathered


def _emptied(hooks: Any) -> dict[Any, Any] | None:
    if not hooks:
        return None
    kept = dict(hooks)
    hooks.clear()
    return kept


def _refill(hooks: Any, kept: dict[Any, Any] | None) -> None:
    if kept is not None:
        hooks.update(kept)


def _add_held(gathered: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each parameter's gathered gradient into ``.grad``, its hooks run once, as autograd does."""
    for param, grad in gathered:
        accumulate(param, grad)


class WeightCapture:
    """Pre-hook of autograd's own node computing only the input gradient (on detached parameters).

    B (deferring) queues ``work(saved, grad_output, needed)`` for W and lets go of ``saved``, so a
    later engine run through the same node (the generic split's W walking a local graph) adds
    nothing twice; a fused backward runs the work right here.  As autograd does for the tensors a
    node saves, the work refuses an activation of ``saved`` (a tensor requiring grad: W reads its
    values) modified in place since the forward; the parameters come detached, W reads only their
    shapes, and one may change in between (an earlier microbatch's optimizer-in-backward hook).
    """

    __slots__ = ("needed", "saved", "store", "versions", "work")

    def __init__(self, store: WeightGradStore, work: Callable[..., None], saved: Any, needed: Sequence[bool]):
        self.store, self.work, self.saved, self.needed = store, work, saved, needed
        self.versions = [t._version if t is not None and t.requires_grad else None for t in saved]

    def __call__(self, grad_outputs: Sequence[torch.Tensor | None]) -> None:
        saved, grad_output = self.saved, grad_outputs[0]
        if saved is None or grad_output is None:
            return
        store = self.store
        if store.deferring:
            self.saved = None
            store.put(partial(self._run, saved, grad_output))
        else:
            self._run(saved, grad_output)

    def _run(self, saved: Any, grad_output: torch.Tensor) -> None:
        for tensor, version in zip(saved, self.versions):
            if version is not None and tensor._version != version:
                raise RuntimeError(
                    f"a tensor of shape {tuple(tensor.shape)} that a weight gradient needs was modified by "
                    f"an in-place operation after the forward (version {version}, now {tensor._version}); "
                    "a plain backward fails the same way: modify a copy (clone() it) instead"
                )
        self.work(saved, grad_output, self.needed)


def accumulate(param: torch.Tensor, grad: torch.Tensor, hooked: bool = False) -> None:
    """``param.grad += grad`` as a plain backward would do it, in the parameter's dtype.

    Under autocast ``grad`` may be computed in the saved tensors' lower precision; it is cast once.
    The parameter's hooks run as autograd's ``AccumulateGrad`` runs them: those of
    ``register_hook`` on the gradient first (one may return a replacement), those of
    ``register_post_accumulate_grad_hook`` after ``.grad`` is updated.  ``hooked``: ``grad`` came
    from an engine run asked for it (``torch.autograd.grad``), which already ran the first kind.
    """
    if grad.dtype != param.dtype:
        grad = grad.to(param.dtype)
    hooks = None if hooked else param._backward_hooks
    if hooks:
        for hook in tuple(hooks.values()):
            replaced = hook(grad)
            if replaced is not None:
                grad = replaced
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)
    _after_accumulate(param)


def _after_accumulate(param: torch.Tensor) -> None:
    """Run ``param``'s post-accumulate-grad hooks, as ``AccumulateGrad`` does after adding."""
    hooks = param._post_accumulate_grad_hooks
    if hooks:
        for hook in tuple(hooks.values()):
            hook(param)


def accumulate_each(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], hooked: bool = False
) -> None:
    """:func:`accumulate` each gradient into its parameter; None (no gradient) is skipped."""
    for param, grad in zip(params, grads):
        if grad is not None:
            accumulate(param, grad, hooked)


def accumulate_aliases(params: Sequence[torch.Tensor], aliases: Sequence[torch.Tensor]) -> None:
    """:func:`accumulate` into each parameter its per-call alias's ``.grad`` (accumulated by
    autograd in B); a parameter that needs no gradient is its own "alias" and gets nothing."""
    accumulate_each(params, [alias.grad if alias.requires_grad else None for alias in aliases])


def accumulate_product(param: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """``param.grad += left @ right``, as one GEMM into the existing gradient when dtypes allow
    (and no ``register_hook`` hook needs the product on its own)."""
    grad = param.grad
    if grad is not None and grad.dtype == left.dtype == right.dtype and not param._backward_hooks:
        grad.addmm_(left, right)
        _after_accumulate(param)
    else:
        accumulate(param, left.mm(right))
