"""Reading autograd graphs in tests."""

from __future__ import annotations

import torch


def node_names(output: torch.Tensor) -> list[str]:
    """The class names of every autograd node ``output`` depends on."""
    names, seen, stack = [], set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names
