"""Each stage of a split model gets the model's own tensors it reads, under the model's names."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["Mirror", "place_tensors"]


class Mirror(nn.Module):
    """Stands for a module of the model whose tensors more than one stage reads: it holds
    this stage's share of them (the same objects) under the module's attribute names."""



def place_tensors(model: nn.Module, stages: Sequence[nn.Module],
                  used: Sequence[set[str]]) -> None:
    """Give each stage the model's tensors it reads (`used[s]`: names in the model), under
    those names: a submodule whole where only that stage reads its tensors (and the object is
    not placed in another stage already), else a Mirror holding the stage's share. Tensors no
    stage reads go with the first stage, so the stages' keys are all of the model's."""
    placed: dict[int, int] = {}
    # A tensor's readers by object: a name no stage reads (BERT's `cls.predictions.bias`,
    # which is `decoder.bias`) goes with the first stage reading the object under another
    # name, so no stage holds it only to make a tie of it.
    tensors = {name: t for name, t in [*model.named_parameters(remove_duplicate=False),
                                       *model.named_buffers(remove_duplicate=False)]}
    readers: dict[int, list[int]] = {}
    for s in range(len(stages)):
        for name in sorted(used[s]):
            if name in tensors and s not in readers.setdefault(id(tensors[name]), []):
                readers[id(tensors[name])].append(s)

    def users(prefix: str) -> list[int]:
        return [s for s in range(len(stages))
                if any(a == prefix or a.startswith(prefix + ".") for a in used[s])]

    def home(module: nn.Module) -> int:
        """The first stage reading any tensor of `module` (under any name), else the first."""
        found = [r for t in [*module.parameters(), *module.buffers()]
                 for r in readers.get(id(t), [])]
        return min(found, default=0)

    def place(prefix: str, module: nn.Module) -> None:
        who = users(prefix)
        s = who[0] if who else home(module)
        if prefix and len(who) <= 1 and placed.get(id(module), s) == s:
            if not who and not _has_tensors(module):
                return
            placed[id(module)] = s
            _attach(stages[s], prefix, lambda parent, name: parent.add_module(name, module))
            return
        for name, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is None:
                continue
            key = f"{prefix}.{name}" if prefix else name
            persistent = name not in module._non_persistent_buffers_set
            for s in [s for s in range(len(stages)) if key in used[s]] or [
                    min(readers.get(id(t), [0]))]:
                _attach(stages[s], key, _setter(t, persistent))
        for name, child in module._modules.items():
            if child is not None:
                place(f"{prefix}.{name}" if prefix else name, child)

    place("", model)


def _has_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _setter(t: torch.Tensor, persistent: bool) -> Callable[[nn.Module, str], None]:
    def put(parent: nn.Module, name: str) -> None:
        if isinstance(t, nn.Parameter):
            parent.register_parameter(name, t)
        else:
            parent.register_buffer(name, t, persistent=persistent)
    return put


def _attach(stage: nn.Module, path: str, put: Callable[[nn.Module, str], None]) -> None:
    """Walk `path` from `stage`, making Mirrors for the modules on the way, and `put` the
    last part there."""
    *parents, last = path.split(".")
    node: nn.Module = stage
    for part in parents:
        child = node._modules.get(part)
        if child is None:
            child = Mirror()
            node.add_module(part, child)
        node = child
    if last not in node._modules and last not in node._parameters and last not in node._buffers:
        put(node, last)
