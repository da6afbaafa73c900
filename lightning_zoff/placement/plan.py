"""The plan: every byte the engine allocates, per unit and per side, decided before any of it is allocated, and frozen.

A unit's optimizer state lives on one side (`Placement`). What it costs there, by buffer:
- on the host: ``master`` (fp32), ``moments`` (fp32 or bf16, one or two), ``grad_landing`` (the reduced shard in the
  parameters' dtype: copied down in backward and held until the step decides; the kernel then writes the updated
  16-bit parameters over it, in place, and they leave for the accelerator from there), ``param_out`` (the 16-bit
  parameters' own buffer, only where the state is not laid out as the gradient: some reduced parameters untrained)
  and ``grad_sum`` (the window's sum, when a window has several micro-batches). The landing and out buffers are pinned.
  Where windows sum on the host with overlap, the host units have no landing or out buffer of their own: one pinned
  staging ring serves them in turn (`ring_bytes`: a shard lands there until the worker adds it into ``grad_sum``, the
  updated 16-bit parameters leave from there), 2 B per parameter less for a few units' worth.
- on the accelerator: ``master``, ``moments`` and ``grad_sum``. No gradient is held per parameter: in a window of one
  micro-batch FSDP2's reduced shard is copied over the unit's own 16-bit shards (the step casts the master over them
  again), in longer ones added into ``grad_sum`` as it arrives; the update writes the 16-bit parameters straight into
  FSDP2's shards. A unit there costs its state beside the model's shard: 4 + 8 + 2 = 14 B per parameter with fp32
  AdamW moments at bf16, 10 with bf16 moments, plus 4 for ``grad_sum``; a host unit leaves 2 on the accelerator.
Beside the units: on the host, overlap's spare sets (each a unit's state and 16-bit copy, lent to one speculating unit
at a time; as many as the host has room for, at most one per two host units); on the accelerator, transients: the
update's fp32 workspace (it runs in pieces of at most `UPDATE_PIECE` elements), with the window's sum on the
accelerator, that sum (one unit's, or every host unit's when retained), and where it runs a share of the host's
updates (`accelerator_update_share`), the slots their pieces pass through: `LEND_SLOTS` pieces of master, moments and
gradient of at most `LEND_PIECE` elements, and one piece's update workspace (`StateOptions.lend_workspace_bytes`).

The engine allocates exactly this (`mover.make_buffers`; a test compares its tensors with the plan, per side), the
budget checks read it, the policy (`policy.py`) places units with it, and the memory report prints it. The policy's
`plan_memory` makes a rank's plan, refusing one that does not fit before anything is allocated (`refusal.py`); a plan
changes only into a new plan (`with_placement`, `moved`, `reordered`).
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from lightning_zoff.placement.machine import Machine, size

if TYPE_CHECKING:
    from lightning_zoff.config import ZoffConfig

UPDATE_PIECE = 1 << 26  # elements an accelerator-side update converts to fp32 at once (256 MiB of workspace)
# elements of a host unit's state that go up to the accelerator at once: 224 MiB with fp32 Adam, far past PCIe's
# efficient size; with the slots and the workspace 0.94 GB of the GPU (1.95 at twice the size: on Qwen3-14B b1, 1x H100,
# the GPU then peaked at 80.3 GB with 35 allocator retries, against 78.5 and 11 without the share)
LEND_PIECE = 1 << 24
LEND_SLOTS = 3  # pieces in flight: one going up, one updated, one coming back
# reduced gradient shards whose copy out of FSDP2's buffer may be pending while backward goes on (`landing.py`)
REDUCED_IN_FLIGHT = 2
# units' landings or 16-bit copies the host's shared staging ring holds at once where "auto" needs one to fit
# (`staging_ring_units`): one being copied down while the worker adds the last into its sum, and one more. Backward
# waits for the ring where the worker's sums fall further behind (`zoff/landing_wait_s` says how long); more units let
# the worker use the next forward's time to catch up. Not by default where the plan fits without: at MegaTrain's
# Qwen2.5-7B configuration on 1x H100 a ring of 3 made backward wait 3.6 s a step and the step 0.47 s slower than a
# landing buffer per unit, though it freed 8 GB of host for units and spared 4 blocks' recompute (2026-12-07)
RING_UNITS = 3


class Placement(enum.Enum):
    """Where a unit's master and moments live and its update runs."""

    HOST = "host"  # the fused CPU kernels; gradients come down, 16-bit parameters go up
    ACCELERATOR = "accelerator"  # torch ops next to the parameters


@dataclass(frozen=True)
class UnitShape:
    name: str
    trained: int  # elements of its state on this rank: the optimizer's parameters, each padded as in the flat shard
    reduced: int  # elements of its reduced gradient: every parameter that requires one
    same_layout: bool  # the state is laid out as the gradient (every reduced parameter is trained)


@dataclass(frozen=True)
class StateOptions:
    param_bytes: int  # of the model's shards: 2 (bf16, fp16) or 4 (32-true)
    moment_bytes: int  # 4 (fp32) or 2 (bf16)
    moments: int  # 2 (Adam, AdamW) or 1 (Lion)
    sum_bytes: int  # of the window's gradient sum; 0 when every window is one micro-batch
    sum_on_accelerator: bool = False  # host units' window sums live on the accelerator between micro-batches
    retain_device_sum: bool = False  # ... for the whole window, every unit's at once
    speculates: bool = True  # host units update during backward, into the host's spare sets
    update_share: str | float = "none"  # of the host's updates the accelerator runs: "auto", "none" or a fraction
    ring_units: int = RING_UNITS  # the staging ring's room, in the largest host unit's landings; 0: no ring
    ring_only_to_fit: bool = False  # "auto": no ring unless the plan fits only with one of RING_UNITS (`plan_memory`)

    @property
    def landing_ring(self) -> bool:
        """Host units share one `StagingRing` instead of a landing buffer each: where windows sum on the host and the
        worker lands each shard while backward goes on (a shard then needs its landing room only until it is added
        into the window's sum, and the updated 16-bit parameters theirs only until they went up)."""
        return self.sum_bytes > 0 and self.speculates and not self.sum_on_accelerator and self.ring_units > 0

    @classmethod
    def of(cls, config: ZoffConfig, *, param_bytes: int, moments: int, sums_windows: bool) -> StateOptions:
        """The options as zoff's configuration sets them, for a model of `param_bytes` and an optimizer of `moments`
        moments; `sums_windows`: some window has several micro-batches."""
        ring = config.staging_ring_units
        return cls(param_bytes=param_bytes, moment_bytes=config.moment_dtype.itemsize, moments=moments,
                   sum_bytes=config.grad_sum_dtype.itemsize if sums_windows else 0,
                   sum_on_accelerator=config.grad_accum_on == "accelerator",
                   retain_device_sum=config.retain_gpu_grad_partition_until_step,
                   speculates=config.host_worker, ring_units=ring if isinstance(ring, int) else 0,
                   ring_only_to_fit=ring == "auto",
                   # the share streams the host's state: only pinned memory copies without stopping the host's thread
                   update_share=config.accelerator_update_share if config.offload and config.pin_memory else "none")

    def with_ring(self) -> StateOptions:
        """"auto"'s other choice, where a landing buffer per host unit does not fit: the ring of `RING_UNITS`."""
        return replace(self, ring_units=RING_UNITS, ring_only_to_fit=False)

    def state_bytes(self, trained: int) -> int:
        return trained * (4 + self.moments * self.moment_bytes)

    def out_bytes(self, trained: int) -> int:
        """A 16-bit copy of the state's parameters (fp32 models send the master itself)."""
        return 0 if self.param_bytes == 4 else trained * self.param_bytes

    def workspace_bytes(self, trained: int, lion: bool = False) -> int:
        """An accelerator-side update's fp32 temporaries: the scaled gradient, Lion's direction, fp32 copies of 16-bit
        moments; for one piece of at most `UPDATE_PIECE` elements."""
        per_element = 4 * (1 + (1 if lion else 0) + (self.moments if self.moment_bytes != 4 else 0))
        return per_element * min(trained, UPDATE_PIECE)

    def lend_workspace_bytes(self, elements: int) -> int:
        """A lent piece's update temporaries (`optim/host_math.py`): the fp32 gradient, an fp32 and an fp64 temporary,
        fp32 copies of 16-bit moments."""
        return elements * (4 + 4 + 8 + (4 * self.moments if self.moment_bytes != 4 else 0))

    @property
    def lent_grad_bytes(self) -> int:
        """Bytes of a lent element's gradient: the window sum's dtype or the model's, the wider."""
        return max(self.sum_bytes, self.param_bytes)

    def lend_slot_bytes(self, elements: int) -> int:
        """One slot a lent update's piece of `elements` passes through: its master, moments and gradient."""
        return self.state_bytes(elements) + elements * self.lent_grad_bytes


def unit_buffers(shape: UnitShape, options: StateOptions, placement: Placement) -> dict[str, int]:
    """Bytes of each buffer the engine allocates for the unit at `placement` (`mover.make_buffers` makes them)."""
    buffers = {"master": 4 * shape.trained, "moments": options.moments * options.moment_bytes * shape.trained,
               "grad_sum": options.sum_bytes * shape.reduced}
    if placement is Placement.HOST and not options.landing_ring:
        buffers["grad_landing"] = options.param_bytes * shape.reduced
        buffers["param_out"] = 0 if shape.same_layout else options.out_bytes(shape.trained)
    return buffers


def ring_bytes(host_units: list[UnitShape], options: StateOptions) -> int:
    """The shared `StagingRing` of the host units (`StateOptions.landing_ring`; 0 without): room for `ring_units` of
    the largest unit's landing or 16-bit copy, never more than the units' own buffers would take."""
    if not options.landing_ring or not host_units:
        return 0
    largest = max(max(options.param_bytes * s.reduced, options.out_bytes(s.trained)) for s in host_units)
    own = sum(options.param_bytes * s.reduced + (0 if s.same_layout else options.out_bytes(s.trained))
              for s in host_units)
    return min(options.ring_units * largest, own)


def host_bytes_per_element(options: StateOptions) -> int:
    """Host bytes of a unit whose every reduced element is trained, per element, spare sets aside."""
    return sum(unit_buffers(UnitShape("", 1, 1, True), options, Placement.HOST).values())


def accelerator_bytes_per_element(options: StateOptions) -> int:
    """Accelerator bytes of a unit whose every reduced element is trained, per element, where its state lives there."""
    return sum(unit_buffers(UnitShape("", 1, 1, True), options, Placement.ACCELERATOR).values())


@dataclass(frozen=True)
class StepMemory:
    """A step's accelerator memory beside the model's shards and the optimizer state (`step_trace.py` measures it)."""

    activations: int  # traced: the most bytes one micro-batch's own tensors held at once, forward and backward
    gathered: int  # FSDP2's buffers at their most: gathered units, a gradient, reduced shards (`rank.gathered_bytes`)
    batch: str  # what was traced, for the lines that report it: "a batch of 4 x 4096"
    samples: int = 1  # the batch's first dimension: activations scale with it
    flops: int = 0  # traced: the forward's and backward's operations (a recomputed block's forward counts twice)
    # traced: the most the activations and FSDP2's buffers held at one moment (`fsdp_buffers.py`); 0: not traced so
    together: int = 0

    @property
    def total(self) -> int:
        """The step's peak: the most held at one moment where traced so (never under FSDP2's own peak, which the
        trace's order of gradients may not reach), else the two peaks added."""
        return max(self.together, self.gathered) if self.together else self.activations + self.gathered

    def at_samples(self, samples: int) -> StepMemory:
        """The step at a batch of `samples` instead, its activations scaled (an estimate: the trace saw one batch);
        the peak moves by as much as the activations' peak."""
        activations = self.activations * samples // self.samples
        return replace(self, activations=activations, samples=samples, flops=self.flops * samples // self.samples,
                       together=self.together and self.together + activations - self.activations,
                       batch=f"a batch of {samples} (scaled)")

    def describe(self) -> str:
        if self.together:
            return (f"the step at {self.batch} {size(self.total)} at its peak (activations {size(self.activations)}"
                    f" and FSDP2's buffers {size(self.gathered)} at their own)")
        return (f"the step at {self.batch} {size(self.total)} (activations {size(self.activations)}, FSDP2's"
                f" buffers {size(self.gathered)})")


@dataclass(frozen=True)
class MemoryPlan:
    shapes: tuple[UnitShape, ...]  # the units with trained parameters or a reduced gradient, in forward order
    options: StateOptions
    placement: Mapping[str, Placement]
    machine: Machine
    model_bytes: int  # FSDP2's shards of the model on the accelerator (not the engine's, but they must fit beside it)
    lion: bool = False
    spare_sets: int = 0
    spare_shape: UnitShape | None = None  # the shape the spare sets are made for
    step: StepMemory | None = None  # the step's own memory on the accelerator, where a batch was traced

    # -- what the plan holds -----------------------------------------------------------------------------------

    def shape(self, name: str) -> UnitShape:
        return next(s for s in self.shapes if s.name == name)

    def buffers(self, name: str) -> dict[str, int]:
        return unit_buffers(self.shape(name), self.options, self.placement[name])

    def units_on(self, placement: Placement) -> list[UnitShape]:
        return [s for s in self.shapes if self.placement[s.name] is placement]

    def state_on(self, placement: Placement) -> int:
        """The units' buffers on that side."""
        return sum(sum(unit_buffers(s, self.options, placement).values()) for s in self.units_on(placement))

    def spare_set_bytes(self) -> int:
        shape = self.spare_shape
        return 0 if shape is None else self.options.state_bytes(shape.trained) + self.options.out_bytes(shape.trained)

    @property
    def ring_bytes(self) -> int:
        """The host units' shared staging ring (`StateOptions.landing_ring`), 0 without."""
        return ring_bytes(self.units_on(Placement.HOST), self.options)

    @property
    def ring_bound(self) -> int:
        """The staging ring's size with every unit on the host: the most it grows to as units move there."""
        return ring_bytes(list(self.shapes), self.options)

    @property
    def host_bytes(self) -> int:
        return self.state_on(Placement.HOST) + self.spare_sets * self.spare_set_bytes() + self.ring_bytes

    @property
    def lends(self) -> bool:
        """The accelerator runs a share of the host units' updates: a fraction asked for, or "auto" on a GPU."""
        share = self.options.update_share
        return isinstance(share, float) or (share == "auto" and self.machine.accelerator_capacity is not None)

    @property
    def lend_piece(self) -> int:
        """Elements of a lent update's piece: `LEND_PIECE`, or the largest host unit's state where that is less; 0
        when nothing is lent."""
        largest = max((s.trained for s in self.units_on(Placement.HOST)), default=0)
        return min(LEND_PIECE, largest) if self.lends else 0

    @property
    def lend_slots_bytes(self) -> int:
        """The slots lent updates pass through, on the accelerator (`offload/lending.py` allocates them)."""
        return LEND_SLOTS * self.options.lend_slot_bytes(self.lend_piece)

    @property
    def lending_bytes(self) -> int:
        """The slots and one piece's update workspace."""
        return self.lend_slots_bytes + self.options.lend_workspace_bytes(self.lend_piece)

    @property
    def accelerator_transient_bytes(self) -> int:
        """The update's workspace, the window's sums on the accelerator and the lent updates' slots, at most at once."""
        on_accelerator = self.units_on(Placement.ACCELERATOR)
        workspace = max((self.options.workspace_bytes(s.trained, self.lion) for s in on_accelerator), default=0)
        sums = 0
        if self.options.sum_on_accelerator and self.options.sum_bytes:
            host_sums = [4 * s.reduced for s in self.units_on(Placement.HOST)]
            sums = sum(host_sums) if self.options.retain_device_sum else max(host_sums, default=0)
        return workspace + sums + self.lending_bytes

    @property
    def accelerator_bytes(self) -> int:
        """The engine's own on the accelerator: the units' state and the transients."""
        return self.state_on(Placement.ACCELERATOR) + self.accelerator_transient_bytes

    @property
    def step_bytes(self) -> int:
        """The step's own memory on the accelerator: 0 where no batch was traced (the plan then counts no
        activations)."""
        return 0 if self.step is None else self.step.total

    @property
    def accelerator_reserve(self) -> int:
        """Left free on the accelerator: "auto"'s margin where the step was not traced (room for its activations),
        the allocator's slack where it was."""
        return self.machine.accelerator_margin if self.step is None else self.machine.accelerator_slack

    @property
    def accelerator_need(self) -> int:
        """What the accelerator must hold at the step's peak: the model's shards, the engine's bytes, the step's own
        and what is left free."""
        return self.model_bytes + self.accelerator_bytes + self.step_bytes + self.accelerator_reserve

    # -- checks ------------------------------------------------------------------------------------------------

    def host_setup_peak(self, masters_bytes: int) -> int:
        """The most the host holds while the state is built from `masters_bytes` of fp32 copies: the accelerator's
        units first (their copies go), then each host unit, freeing its copy once its state holds it; the spare sets
        last, once every copy is gone."""
        largest = max((4 * s.trained for s in self.units_on(Placement.HOST)), default=0)
        return max(masters_bytes, self.state_on(Placement.HOST) + largest, self.host_bytes)

    def problems(self, masters_bytes: int = 0) -> list[str]:
        """What does not fit (empty when the plan fits)."""
        found = []
        host_need = self.host_setup_peak(masters_bytes)
        if host_need > self.machine.host_capacity:
            found.append(f"the host ({size(host_need)} needed, {size(self.machine.host_capacity)} usable)")
        capacity = self.machine.accelerator_capacity
        if capacity is not None and self.accelerator_need > capacity:
            step = "before activations" if self.step is None else "at the step's peak"
            found.append(f"the accelerator ({size(self.accelerator_need)} needed {step}: model"
                         f" {size(self.model_bytes)}, optimizer state {size(self.accelerator_bytes)}, "
                         + ("" if self.step is None else self.step.describe() + ", ")
                         + f"{'margin' if self.step is None else 'slack'} {size(self.accelerator_reserve)};"
                         f" {size(capacity)} usable)")
        return found

    # -- changes -----------------------------------------------------------------------------------------------

    def with_placement(self, placement: Mapping[str, Placement]) -> MemoryPlan:
        """The plan with units placed anew and the spare sets sized for the host's room then."""
        plan = replace(self, placement=dict(placement), spare_sets=0, spare_shape=None)
        return plan._with_spare_sets()

    def moved(self, names: Sequence[str], placement: Placement) -> MemoryPlan:
        return self.with_placement({**self.placement, **dict.fromkeys(names, placement)})

    def reordered(self, shapes: Sequence[UnitShape]) -> MemoryPlan:
        """The same plan with the units in another forward order (the one the first forward showed)."""
        return replace(self, shapes=tuple(shapes))

    def _with_spare_sets(self) -> MemoryPlan:
        host = [s for s in self.units_on(Placement.HOST) if s.trained]
        if not self.options.speculates or not host:
            return self
        sizes = Counter(s.trained for s in host)
        trained, count = sizes.most_common(1)[0]
        shape = next(s for s in host if s.trained == trained)
        plan = replace(self, spare_shape=shape)
        room = self.machine.host_capacity - plan.host_bytes
        sets = min(max(1, count // 2), max(0, room) // max(1, plan.spare_set_bytes()))
        return replace(plan, spare_sets=sets)

    # -- report ------------------------------------------------------------------------------------------------

    def report(self) -> dict[str, float]:
        """Bytes by kind and side, and per element of this rank's trained state."""
        host = self.units_on(Placement.HOST)

        def total(kind: str, units: list[UnitShape], placement: Placement) -> int:
            return sum(unit_buffers(s, self.options, placement).get(kind, 0) for s in units)

        trained = sum(s.trained for s in self.shapes)
        on_accelerator = self.units_on(Placement.ACCELERATOR)
        report = {
            "trained_params": trained,
            "host_master": total("master", host, Placement.HOST),
            "host_optimizer_state": total("moments", host, Placement.HOST),
            "host_grad_sum": total("grad_sum", host, Placement.HOST),
            "host_staging": total("grad_landing", host, Placement.HOST) + total("param_out", host, Placement.HOST)
            + self.ring_bytes,
            "host_spare_state": self.spare_sets * self.spare_set_bytes(),
            "spare_sets": self.spare_sets,
            "staging_ring_units": self.options.ring_units if self.options.landing_ring else 0,
            "host_total": self.host_bytes,
            "host_capacity": self.machine.host_capacity,
            "host_kept": self.machine.host_kept,
            "loader_workers": self.machine.loader_workers,
            "accelerator_optimizer_state": self.state_on(Placement.ACCELERATOR),
            "accelerator_transient": self.accelerator_transient_bytes,
            "accelerator_lending": self.lending_bytes,
            "accelerator_model": self.model_bytes,
            "accelerator_step": self.step_bytes,
            "host_bytes_per_trained_param": self.host_bytes / max(1, sum(s.trained for s in host)),
        }
        if self.machine.accelerator_capacity is not None:
            report["accelerator_capacity"] = self.machine.accelerator_capacity
        report["accelerator_units"] = len(on_accelerator)
        report["host_units"] = len(host)
        return report
