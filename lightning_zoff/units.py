"""Which modules become FSDP2 units: the unit policy, over any module tree.

- **Blocks**: the children of every `nn.ModuleList` whose children repeat one class (or the classes `wrap_policy`
  names), the outermost where they nest. A block that shares a parameter with a module outside it is not a unit of
  its own (its parameters go with the rest).
- **The rest**: walking down from the root, each module holding parameters that no block holds becomes a unit if it
  has a forward of its own (FSDP2 gathers a unit's parameters in its forward hooks). A container without one
  (`nn.ModuleDict`, a `nn.ModuleList` of different modules) is walked into, never a unit: nanoGPT's and LitGPT's
  `transformer = nn.ModuleDict(wte=..., h=..., ln_f=...)` gives the units `transformer.wte` and `transformer.ln_f`.
- **Models of known libraries** (transformers' own, LitGPT's, this package's example GPT) that hold no parameter
  themselves are walked into too: their code calls the embedding, the final norm and the LM head as modules, so each
  becomes a unit of its own instead of one unit of them all. That unit would stay gathered from the first forward to
  the end of backward, its reduce would come last (2.1 GB for Llama-3-8B's embedding and head, with its gradients
  beside it), and the head's update would wait for the embedding's gradient.
- **Tied parameters**: modules of the rest that share a parameter (nanoGPT's `transformer.wte` and `lm_head`) are one
  unit, sharded as one FSDP2 group (`fully_shard([wte, lm_head])`): gathered from the first one's forward until the
  last one's has run, reduced once, at the end of backward, with both modules' gradients in it.
- **Parameters of the root itself**, or of a container without forward that holds its own: only the root's forward
  can gather them. Fabric calls the model, so there the root is a unit for them (`root_runs_forward`); the Trainer
  calls `training_step`, which need not call the LightningModule's forward, so there they are refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

ROOT = "(root)"  # the name of the unit that is the root module itself


@dataclass(frozen=True, eq=False)
class Unit:
    """One FSDP2 unit: a module, or several modules that share parameters (sharded as one group)."""

    name: str  # the module's name in the model; a group's names joined by "+"; `ROOT` for the root itself
    modules: tuple[nn.Module, ...]
    paths: tuple[str, ...]  # each module's name in the model ("" for the root)
    is_block: bool = False  # one of the repeated blocks (or of `wrap_policy`'s classes), not of the rest

    @property
    def module(self) -> nn.Module:
        """The module FSDP2's unit API is called on (every module of a group shares the group's state)."""
        return self.modules[0]

    def holds(self, param_name: str) -> bool:
        """Whether the parameter of that name (in the model) lies under one of the unit's modules."""
        return any(not path or param_name.startswith(f"{path}.") for path in self.paths)


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The default policy's blocks: children of every `nn.ModuleList` whose children repeat one class."""
    blocks: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1:
            blocks.extend(module)
    return blocks


def plan_units(model: nn.Module, wrap_policy: Iterable[type[nn.Module]] | None = None, *,
               root_runs_forward: bool = False) -> list[Unit]:
    """The units of `model` in the order they must be sharded (inner first): the blocks, then the rest (see the
    module's docstring), then the root itself where it holds what no other unit can. `root_runs_forward`: the
    training loop calls `model(...)` (Fabric), so the root's forward hooks run."""
    names = {m: n for n, m in model.named_modules()}
    holders = _holders(model)
    blocks = _blocks(model, wrap_policy, holders)
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    rest, orphans = _rest(model, in_blocks)
    if orphans and not root_runs_forward:
        owner = orphans[0]
        where = type(model).__name__ + (f".{names[owner]}" if owner is not model else "")
        raise ValueError(
            f"{where} holds parameters directly, and only a module's forward lets FSDP2 gather a unit's parameters:"
            f" {'the LightningModule' if owner is model else f'{type(owner).__name__} has no forward and'} is not"
            " called as a module in training. Move these parameters into a submodule whose forward uses them (for"
            " example `self.model = MyNet()`)."
        )
    units = [Unit(names[b], (b,), (names[b],), is_block=True) for b in blocks]
    units += [_unit_of(group, names) for group in _tied_groups(rest, holders)]
    if orphans:
        units.append(Unit(ROOT, (model,), ("",)))
    return units


def forward_order(model: nn.Module, units: list[Unit]) -> list[str]:
    """The units' names in the order a forward is expected to enter them: modules are usually registered in that
    order (the engine learns the truth from the first forward). A group enters with its first module; the root
    first of all."""
    position = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return [u.name for u in sorted(units, key=lambda u: min(position.get(p, len(position)) for p in u.paths))]


def _blocks(model: nn.Module, wrap_policy: Iterable[type[nn.Module]] | None,
            holders: dict[int, list[nn.Module]]) -> list[nn.Module]:
    if wrap_policy:
        classes = tuple(wrap_policy)
        candidates = [m for m in model.modules() if isinstance(m, classes) and m is not model]
    else:
        candidates = repeated_blocks(model)
    # a block sharing a parameter with a module outside it would be sharded twice and break the tie
    candidates = [m for m in candidates if not _shares_outside(m, holders)]
    chosen = set(candidates)  # the outermost: a block inside another block is covered by it
    return [m for m in candidates if not any(a in chosen for a in _ancestors(model, m))]


def _rest(model: nn.Module, in_blocks: set[int]) -> tuple[list[nn.Module], list[nn.Module]]:
    """The modules with a forward that hold the parameters no block holds, and the modules without one (the root,
    containers) that hold such parameters directly."""
    units: list[nn.Module] = []
    orphans: list[nn.Module] = []

    def outside_blocks(module: nn.Module, recurse: bool) -> bool:
        return any(id(p) not in in_blocks for p in module.parameters(recurse=recurse))

    def walk(module: nn.Module) -> None:
        if outside_blocks(module, recurse=False):
            orphans.append(module)
        for child in module.children():
            if not outside_blocks(child, recurse=True):
                continue
            if _has_forward(child) and not _walked_into(child):
                units.append(child)
            else:
                walk(child)

    walk(model)
    return units, orphans


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


# Libraries whose models call their embedding, norm and head as modules: transformers' own (not remote code, which may
# read a child's weight in its own forward: MPT's tied output, which only a unit around both can gather), LitGPT's, and
# this package's example GPT
CALL_CHILDREN_AS_MODULES = ("transformers.models.", "litgpt.", "lightning_zoff.examples.")


def _walked_into(module: nn.Module) -> bool:
    """A model of those libraries that holds no parameter itself: its children are units (the module's docstring)."""
    known = type(module).__module__.startswith(CALL_CHILDREN_AS_MODULES)
    return known and next(module.parameters(recurse=False), None) is None


def _tied_groups(modules: list[nn.Module], holders: dict[int, list[nn.Module]]) -> list[list[nn.Module]]:
    """`modules` in groups that share parameters (each module alone unless tied), in `modules`' order."""
    index = {inner: i for i, m in enumerate(modules) for inner in m.modules()}
    parent = list(range(len(modules)))

    def find(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for owners in holders.values():
        tied = sorted({find(index[h]) for h in owners if h in index})
        for i in tied[1:]:
            parent[i] = tied[0]
    groups: dict[int, list[nn.Module]] = {}
    for i, m in enumerate(modules):
        groups.setdefault(find(i), []).append(m)
    return list(groups.values())


def _unit_of(group: list[nn.Module], names: dict[nn.Module, str]) -> Unit:
    paths = tuple(names[m] for m in group)
    return Unit("+".join(paths), tuple(group), paths)


def _holders(model: nn.Module) -> dict[int, list[nn.Module]]:
    """Every module that holds each parameter directly, by id of the parameter (tied parameters have several)."""
    holders: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), []).append(module)
    return holders


def _shares_outside(unit: nn.Module, holders: dict[int, list[nn.Module]]) -> bool:
    inside = set(unit.modules())
    return any(m not in inside for p in unit.parameters() for m in holders[id(p)])


def _ancestors(root: nn.Module, target: nn.Module) -> list[nn.Module]:
    for name, module in root.named_modules():
        if module is target:
            parts = name.split(".")
            return [root.get_submodule(".".join(parts[:i])) for i in range(1, len(parts))]
    return []
