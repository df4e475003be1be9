"""Which component is running: module hooks in forward, autograd-node pre-hooks in backward.

Models declare a `component` attribute on the modules that make up each component. Forward
attribution is a stack pushed/popped by module hooks. Backward attribution tags every autograd
node a component call created (the nodes between its output and its inputs) and sets the label
from a pre-hook on each node, so a backward kernel is credited to the component that caused it.
(FlopCounterMode's own module tracker misattributes backward matmuls between sibling modules.)
"""
from __future__ import annotations

import torch
from torch import nn

COMPONENTS = ("embedding", "attention", "norm", "mlp", "loss")


def component_modules(model: nn.Module) -> dict[str, str]:
    """Fully-qualified module name -> component, for the outermost modules that declare one."""
    out: dict[str, str] = {}
    for name, mod in model.named_modules():
        comp = getattr(mod, "component", None)
        if comp and not any(name.startswith(p + ".") for p in out):
            out[name] = comp
    return out


def _grad_fns(obj) -> list:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj.grad_fn] if obj.grad_fn is not None else []
    if isinstance(obj, (tuple, list)):
        return [g for o in obj for g in _grad_fns(o)]
    if isinstance(obj, dict):
        return [g for o in obj.values() for g in _grad_fns(o)]
    return []


class ComponentTracker:
    """`label` names the component running now, in forward and (with track_backward) in backward."""

    def __init__(self, model: nn.Module, track_backward: bool = False):
        self.model, self.track_backward = model, track_backward
        self.label = "other"
        # one entry per open call: (label before it, input grad_fns or None when not recorded)
        self._stack: list[tuple[str, list | None]] = []
        # finished calls, innermost first: (component, input grad_fns, output grad_fns)
        self._calls: list[tuple[str, list, list]] = []
        self._handles: list = []

    def _pre(self, comp):
        def hook(module, args, kwargs):
            # a call inside backward is a checkpoint's recompute: it runs under the label of the node
            # that asked for it, and its nodes are not tagged (that graph is never walked)
            record = self.track_backward and torch._C._current_graph_task_id() == -1
            self._stack.append((self.label, _grad_fns(args) + _grad_fns(kwargs) if record else None))
            self.label = comp
        return hook

    def _post(self, module, args, kwargs, output) -> None:  # must return None: the output is kept
        comp = self.label
        self.label, ins = self._stack.pop()
        if ins is not None:
            self._calls.append((comp, ins, _grad_fns(output)))

    def __enter__(self):
        for name, comp in component_modules(self.model).items():
            mod = self.model.get_submodule(name)
            self._handles.append(mod.register_forward_pre_hook(self._pre(comp), with_kwargs=True))
            self._handles.append(mod.register_forward_hook(self._post, with_kwargs=True))
        return self

    def tag_backward(self) -> None:
        """After the forward: tag each call's autograd nodes so backward sets `label` as they run.
        Calls are tagged innermost first, so a component called inside another (the norm inside a
        recomputed MLP) keeps its own nodes."""
        tagged: set = set()
        for comp, ins, outs in self._calls:
            stop, todo = set(ins), list(outs or [])
            while todo:
                node = todo.pop()
                if node is None or node in stop or node in tagged:
                    continue
                tagged.add(node)
                self._handles.append(node.register_prehook(self._enter_node(comp)))
                todo.extend(n for n, _ in node.next_functions)

    def _enter_node(self, comp):
        def hook(grad_outputs):
            self.label = comp
        return hook

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False
