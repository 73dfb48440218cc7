"""The forward installed on a fast-path module, and the two ways it splits a call's backward.

Where it can, the call builds autograd's own (C++) node — on detached parameters, so the node
computes only the input gradient, or on per-call alias parameters for a norm whose kernel computes
all gradients at once — and a hook on that node hands W its work.  Otherwise (a first stage's
input, saved-tensor hooks, a user rule) :class:`SplitFunction` runs the rule's own backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from .rules import SplitRule, autocast_cast
from .store import (
    WeightCapture,
    WeightGradStore,
    accumulate_aliases,
    accumulate_each,
    computing_node,
    top_saved_tensor_hooks,
)

_NO_GRADIENTS = (None, None, None)  # for SplitFunction's plan, parameters and keeper


class FastPlan:
    """What every call of one fast-path module shares, worked out once when the split is installed.

    The backward of each layer runs once per microbatch, so the per-call Python is kept to a few
    attribute reads: the rule's parameter names, where the parameters live and which of the rule's
    methods W calls are all fixed here.
    """

    __slots__ = (
        "module", "names", "native", "parameters", "rule", "store", "weight_work",
        "weights_in_b",
    )  # fmt: skip

    def __init__(self, rule: SplitRule, module: nn.Module, store: WeightGradStore):
        self.rule, self.module, self.store = rule, module, store
        self.names = rule.param_names(module)
        self.parameters = module._parameters  # one dict lookup a name, not nn.Module.__getattr__
        self.weights_in_b = rule.weights_in_b
        self.native = rule.native_backward
        # W: the rule's own accumulate (e.g. one GEMM into .grad), or its weight_grads added here
        overridden = type(rule).accumulate is not SplitRule.accumulate
        self.weight_work: Callable[..., None] = (
            partial(rule.accumulate, module) if overridden else self._accumulate_weight_grads
        )

    @staticmethod
    def covers(rule: SplitRule, module: nn.Module) -> bool:
        """Whether the rule's parameter names are all parameters of the module itself.

        Not so for a parametrized weight (``torch.nn.utils.parametrize``: a tensor computed from
        other parameters); such a module takes the generic split, which finds the real leaves.
        """
        own = module._parameters
        return all(own.get(name) is not None for name in rule.param_names(module))

    def params(self) -> list[torch.Tensor]:
        """The module's current parameters, in :attr:`names` order."""
        own = self.parameters
        return [own[name] for name in self.names]  # type: ignore[misc]  # covers(): none is None

    def run(self, x: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
        """The split forward of one call: autograd's own node where it can, else :class:`SplitFunction`.

        The native node needs a differentiable input (else nothing would call the hook; a first
        stage's input has no gradient) and no saved-tensor hooks (checkpointing, offloading: the
        reference W keeps would bypass them). Inside a generic module's local graph a norm's alias
        parameters would look like leaves of that graph, so norms use the function there.
        """
        if self.native and top_saved_tensor_hooks(False) is None:
            if self.weights_in_b:
                if not self.store.in_local_scope:
                    return self._run_on_aliases(x, params)
            elif x.requires_grad:
                return self._run_input_only(x, params)
        # the parameters are no inputs of the node: B would run their hooks with no gradient (and
        # pay a node task for each); a first stage's output requires grad through the keeper
        keeper = None if x.requires_grad else self.store.keeper(x.device)
        return SplitFunction.apply(x, self, params, keeper)

    def _run_input_only(self, x: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
        # detached parameters: autograd's node computes the input gradient only (its output mask)
        needed = tuple(p.requires_grad for p in params)
        out, saved = self.rule.forward(self.module, x, [p.detach() for p in params])
        # a hook on the node, not on the tensor: an in-place op on ``out`` later moves its grad_fn
        self._node_of(out).register_prehook(WeightCapture(self.store, self.weight_work, saved, needed))
        return out

    def _run_on_aliases(self, x: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
        # per-call leaves sharing the parameters' storage: autograd's node computes all gradients
        aliases = [p.detach().requires_grad_() if p.requires_grad else p for p in params]
        out = self.rule.forward(self.module, x, aliases)[0]
        node = self._node_of(out)
        # in an executor's forward no hook is needed: autograd accumulates the aliases' gradients
        # in C++ and the store hands them to W (or adds them at a fused backward's end)
        if not self.store.after_backward(partial(self._add_alias_grads, aliases)):
            node.register_hook(_GradsOfAliases(self))
        return out

    def _add_alias_grads(self, aliases: list[torch.Tensor]) -> None:
        accumulate_aliases(self.params(), aliases)

    def _node_of(self, out: torch.Tensor) -> Any:
        node = computing_node(out)
        if node is None:
            raise RuntimeError(
                f"{type(self.rule).__name__}.native_backward is set, but its forward returned a "
                "tensor without an autograd node: set native_backward = False for this rule"
            )
        return node

    def backward(
        self, ctx: Any, saved: Any, input_needed: bool, needed: Sequence[bool], grad_output: torch.Tensor
    ) -> tuple[Any, ...]:
        """B (deferring: parameter work queued for W) or a fused BW (parameter work done at once).

        Either way the parameter gradients go into ``.grad`` by W's own code, as the native nodes'
        hooks do: one ``addmm_`` into an existing ``.grad`` for a linear layer instead of a fresh
        gradient that autograd then adds (on CPU a fresh 4 MiB buffer a layer and microbatch costs
        page faults too).  ``ctx.queued`` marks a node whose work B queued (as in
        :class:`~.routed.LinearSplit`): an engine run passing it again (the generic split's W walking
        a local graph) computes only the input gradient.
        """
        rule, module, store = self.rule, self.module, self.store
        if ctx.queued:
            grad_x = rule.input_grad(module, saved, grad_output) if input_needed else None
            return (grad_x, *_NO_GRADIENTS)
        deferring = ctx.queued = store.deferring
        if self.weights_in_b:
            grad_x, grads = rule.all_grads(module, saved, grad_output, input_needed, needed)
            if deferring:
                store.put(partial(self._add_grads, grads))
            else:
                self._add_grads(grads)
            return (grad_x, *_NO_GRADIENTS)
        grad_x = rule.input_grad(module, saved, grad_output) if input_needed else None
        if deferring:
            store.put(partial(self.weight_work, saved, grad_output, needed))
        else:
            self.weight_work(saved, grad_output, needed)
        return (grad_x, *_NO_GRADIENTS)

    def _accumulate_weight_grads(self, saved: Any, grad_output: torch.Tensor, needed: Sequence[bool]) -> None:
        self._add_grads(self.rule.weight_grads(self.module, saved, grad_output, needed))

    def _add_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        accumulate_each(self.params(), grads)


class _GradsOfAliases:
    """Post-hook of a native node computing every gradient (``weights_in_b``) on alias parameters.

    Takes the parameter gradients out of the node's results (the aliases get none) and queues
    them for W, or adds them into ``.grad`` at once in a fused backward.
    """

    __slots__ = ("count", "plan")

    def __init__(self, plan: FastPlan):
        self.plan, self.count = plan, len(plan.names)

    def __call__(self, grad_inputs: Sequence[torch.Tensor | None], grad_outputs: Any) -> tuple[Any, ...]:
        grads = grad_inputs[1 : 1 + self.count]
        store = self.plan.store
        if store.deferring:
            store.put(partial(self.plan._add_grads, grads))
        else:
            self.plan._add_grads(grads)
        return (grad_inputs[0], *(None,) * (len(grad_inputs) - 1))


class SplitFunction(torch.autograd.Function):
    """A module's forward whose backward computes the input gradient and defers the parameters'.

    The (possibly autocast-cast) parameters come as a list, not as inputs of the node: their
    gradients reach ``.grad`` by the plan's own code, in W or at once in a fused backward.
    ``keeper`` is None, or when ``x`` needs no gradient (a first stage) the store's keeper, an
    input that makes the output require grad so that B reaches the node.
    """

    @staticmethod
    def forward(ctx, x, plan, params, keeper):
        out, saved = plan.rule.forward(plan.module, x, params)
        ctx.save_for_backward(*saved)
        ctx.plan = plan
        ctx.needed = tuple(p.requires_grad for p in params)
        ctx.queued = False
        # a view (F.linear's result on a 3-D input) would make autograd refuse an in-place op on
        # the output that a plain forward allows; a detached alias of the same memory is no view
        return out.detach() if out._is_view() else out

    @staticmethod
    def backward(ctx, grad_output):
        # attributes of ctx are C++ properties building new tuples: each is read once
        return ctx.plan.backward(ctx, ctx.saved_tensors, ctx.needs_input_grad[0], ctx.needed, grad_output)


def fast_forward(plan: FastPlan, fallback: Callable[..., Any]) -> Callable[..., Any]:
    """The forward installed on the module of ``plan``.

    Calls the rule with one positional tensor; any other call (keywords, extra arguments) and, if
    the rule says so, calls under autocast take ``fallback`` (the generic split, or the module's own
    forward where the generic split is not installed).
    """
    rule = plan.rule

    def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
            return fallback(module, *args, **kwargs)
        x = args[0]
        params = plan.params()
        if not torch.is_grad_enabled() or not any(p.requires_grad for p in params):
            return type(module).forward(module, x)
        device = x.device.type
        if torch.is_autocast_enabled(device) and rule.autocast != "keep":
            if rule.autocast == "generic":
                return fallback(module, x)
            # an op autocast runs in lower precision: cast as autocast would, then run without it;
            # B and W then compute in the saved tensors' dtype and W casts into the parameter's dtype
            dtype = torch.get_autocast_dtype(device)
            x = autocast_cast(x, dtype)
            params = [autocast_cast(p, dtype) for p in params]
            with torch.autocast(device, enabled=False):
                return plan.run(x, params)
        return plan.run(x, params)

    return forward
