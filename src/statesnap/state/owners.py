"""Which module of the state names an optimizer's parameters, for PyTorch's state-dict helper.

The helper keys an optimizer's state by the names its module gives the parameters, and walks all
of that module's parameters to find them: an optimizer per parameter (optimizers in backward,
layer-wise optimizers) made a save of a model of 2,000 parameters take 82 s, quadratic. An
optimizer that holds a small part of a plain module's parameters is therefore handed a module
holding only those, under the same names.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from .items import SEP
from .module_state import renamed_by_helper
from .placement import is_dtensor


class OwnerFinder:
    """``owner_of`` for the optimizers of one state, with what it learns of the state's modules
    (their parameters, their names) kept for the next optimizer."""

    def __init__(self, named_modules: list[tuple[str, nn.Module]],
                 named_tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]]):
        self._named_modules = named_modules
        self._named_tensors = named_tensors  # the tensors of the state outside its modules, by name
        self._params: dict[int, frozenset] = {}  # module id -> ids of its parameters
        self._names: dict[int, dict[int, list[str]]] = {}  # module id -> parameter id -> its names
        self._renamed: dict[int, bool] = {}  # module id -> renamed_by_helper

    def owner_of(self, optim: torch.optim.Optimizer) -> nn.Module | None:
        """The module of the state whose parameter names key the optimizer's state: one that
        holds all its parameters (or a module of only those, under their names there), else the
        modules of the state that hold them together (an encoder and a decoder under their own
        keys), under their names in the state."""
        params = [p for group in optim.param_groups for p in group["params"]]
        wanted = {id(p) for p in params}
        held = []
        for fqn, module in self._named_modules:
            mine = self._params_of(module)
            if wanted <= mine:
                return self._narrowed(module, params, len(mine))
            if not wanted.isdisjoint(mine):
                held.append((fqn, module))
        covered = set().union(*(self._params_of(module) for _, module in held))
        if wanted <= covered:
            return container(held)
        # Parameters held in the state itself (a learned temperature beside the model, a list of
        # tensors): named as the state names them, not by their positions in the optimizer, which
        # a run that lists them in another order would have given each other's state.
        loose = {}
        for fqn, t in self._named_tensors():
            if id(t) in wanted and id(t) not in covered:
                loose.setdefault(id(t), (fqn, t))
        if wanted <= covered | loose.keys():
            return container(held, list(loose.values()))
        return None

    def _params_of(self, module: nn.Module) -> frozenset:
        if id(module) not in self._params:
            self._params[id(module)] = frozenset(id(p) for p in module.parameters())
        return self._params[id(module)]

    def _narrowed(self, module: nn.Module, params: list[torch.Tensor], held: int) -> nn.Module:
        """``module``, or where the optimizer holds under half of its parameters, a module holding
        only those under the names ``module`` gives them (the same names in the state dict). Not
        where a wrapper renames them, a parameter has two names (tied), or is a DTensor: there the
        helper's names are left to the helper."""
        if 2 * len(params) >= held or any(is_dtensor(p) for p in params):
            return module
        if id(module) not in self._renamed:  # (it walks every submodule)
            self._renamed[id(module)] = renamed_by_helper(module)
        if self._renamed[id(module)]:
            return module
        if id(module) not in self._names:
            names: dict[int, list[str]] = {}
            for name, p in module.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), []).append(name)
            self._names[id(module)] = names
        names = self._names[id(module)]
        if any(len(names.get(id(p), ())) != 1 for p in params):
            return module
        narrowed = container([], [(names[id(p)][0], p) for p in params])
        if narrowed is None:
            return module
        narrowed.gathered = (module,)
        return narrowed


class Container(nn.Module):
    """Modules of the state, gathered under their names in it (``container``). ``gathered``:
    those modules, where it holds nothing else, which the reuse of an optimizer's items depends
    on (reuse.py): the container itself is made anew at each save."""

    gathered: tuple = ()


def container(named: list[tuple[str, nn.Module]], tensors: list[tuple[str, torch.Tensor]] = ()) -> nn.Module | None:
    """One module holding ``named`` modules and ``tensors`` under their names in the state
    (``enc``, ``models.dec``, ``extra.temperature``), so that ``named_parameters`` names a
    parameter as the state does; None if a name cannot be a module path (an empty part, one that
    is an attribute of nn.Module, or one given twice)."""
    root = Container()
    made = {id(root)}  # the modules made here, the only ones a path may go through: the state's own are not changed
    try:
        for fqn, member in [*named, *tensors]:
            parent, (*path, last) = root, fqn.split(SEP)
            for part in path:
                if part not in parent._modules:
                    parent.add_module(part, nn.Module())
                    made.add(id(parent._modules[part]))
                parent = parent._modules[part]
                if id(parent) not in made:  # (a name that runs through a module of the state: "model.extra")
                    return None
            if last in parent._modules or last in parent._parameters:
                return None
            if isinstance(member, nn.Module):
                parent.add_module(last, member)
            elif not last or hasattr(parent, last):
                return None
            else:  # (a tensor that requires grad, not only an nn.Parameter, as an optimizer takes it)
                parent._parameters[last] = member
    except (KeyError, TypeError):  # add_module's refusals
        return None
    root.gathered = () if tensors else tuple(module for _, module in named)
    return root
