"""FSDP2's buffers over a step, moment by moment (`placement/fsdp_buffers.py`), and the step's peak with them: the
tracker against a backward counted by hand, the trace of a small model where the two peaks fall apart, and the step's
total, scaled and described."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from helpers.tiny import TinyLM
from lightning_zoff.placement.fsdp_buffers import Fsdp2Buffers, UnitBuffers
from lightning_zoff.placement.plan import REDUCED_IN_FLIGHT, StepMemory
from lightning_zoff.placement.rank import gathered_bytes
from lightning_zoff.placement.step_trace import StepProbe, trace_step_work
from lightning_zoff.units import forward_order, plan_units

CPU = torch.device("cpu")
F32 = 4


def test_a_backward_by_hand_reaches_fsdp2s_most_where_the_largest_unit_reduces():
    # forward order: an 8-byte unit, five of 4, one of 6; one parameter each, one rank (a shard is the whole unit)
    sizes = (8, 4, 4, 4, 4, 4, 6)
    units = UnitBuffers(sizes=sizes, shards=sizes, trained=(1,) * 7, unit_of={})
    buffers = Fsdp2Buffers(units)
    assert buffers.now() == 8 + 4  # forward: a unit and the next gathered, at their most
    buffers.in_backward = True
    assert buffers.now() == 6 + 4  # before any gradient: the last unit and the one before it (prefetched)
    moments = [buffers.grad_arrived(i, sizes[i]) for i in reversed(range(7))]
    # each reduce: the unit and the next gathered, its gradient, its reduce-scatter input (the last one's went first)
    # and the shards of the last four units to reduce, its own among them
    assert REDUCED_IN_FLIGHT + 2 == 4
    assert moments == [6 + 4 + 6 + 6 + 6,
                       4 + 4 + 4 + 4 + (6 + 4),
                       4 + 4 + 4 + 4 + (6 + 4 + 4),
                       4 + 4 + 4 + 4 + (6 + 4 + 4 + 4),
                       4 + 4 + 4 + 4 + (4 + 4 + 4 + 4),
                       4 + 8 + 4 + 4 + (4 + 4 + 4 + 4),
                       8 + 8 + 8 + (4 + 4 + 4 + 8)]
    assert buffers.now() == 8 + 4 + 4 + 4 + 8  # the end: the last input and four shards (the landing frees them)


def test_units_kept_gathered_from_forward_to_backward_count_until_each_reduces():
    # the same units with reshard_after_forward=False: every unit gathered at the forward's end, and in backward
    # every unit not yet reduced, this one among them
    sizes = (8, 4, 4, 4, 4, 4, 6)
    units = UnitBuffers(sizes=sizes, shards=sizes, trained=(1,) * 7, unit_of={}, kept=True)
    buffers = Fsdp2Buffers(units)
    assert buffers.now() == 34  # forward: all seven
    buffers.in_backward = True
    assert buffers.now() == 34
    moments = [buffers.grad_arrived(i, sizes[i]) for i in reversed(range(7))]
    # each reduce: the units not yet reduced, its gradient, its reduce-scatter input and the last four shards
    assert moments == [34 + 6 + 6 + 6,
                       28 + 4 + 4 + (6 + 4),
                       24 + 4 + 4 + (6 + 4 + 4),
                       20 + 4 + 4 + (6 + 4 + 4 + 4),
                       16 + 4 + 4 + (4 + 4 + 4 + 4),
                       12 + 4 + 4 + (4 + 4 + 4 + 4),
                       8 + 8 + 8 + (4 + 4 + 4 + 8)]
    assert units.most == max(moments) == 52
    assert units.forward_most == 34
    assert buffers.now() == 8 + 4 + 4 + 4 + 8  # the end as when resharded: nothing gathered
    frozen = Fsdp2Buffers(UnitBuffers(sizes=(8, 4), shards=(8, 4), trained=(0, 1), unit_of={}, kept=True))
    frozen.in_backward = True
    assert frozen.grad_arrived(1, 4) == (8 + 4) + 4 + 4 + 4  # the frozen unit stays gathered: it never reduces
    assert frozen.now() == 8 + 4 + 4


def test_the_nominal_backward_of_a_model_is_fsdp2s_most_as_gathered_bytes_counts_it():
    model = TinyLM()
    units = plan_units(model)
    order = forward_order(model, units)
    buffers = Fsdp2Buffers(UnitBuffers.of(model, units, 2, order))
    buffers.in_backward = True
    sizes = buffers.units.sizes
    most = 0
    for i in reversed(range(len(sizes))):  # each unit's gradients whole, in reverse forward order
        for _ in range(buffers.units.trained[i] - 1):
            most = max(most, buffers.grad_arrived(i, 0))
        most = max(most, buffers.grad_arrived(i, sizes[i]))
    assert most == gathered_bytes(model, units, 2, order)


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(256, 512, bias=False), nn.ReLU(), nn.Linear(512, 10, bias=False))


def test_the_step_peak_adds_what_is_alive_at_one_moment_not_the_two_peaks():
    model = mlp()
    first, second = model[0].weight, model[2].weight
    w1, w2 = first.numel() * F32, second.numel() * F32
    units = UnitBuffers(sizes=(w1, w2), shards=(w1, w2), trained=(1, 1), unit_of={id(first): 0, id(second): 1})
    probe = StepProbe(lambda: torch.zeros(64, 256), lambda x: model(x).pow(2).mean(), contextlib.nullcontext)
    work = trace_step_work(model, probe, torch.zeros(64, 256), CPU, torch.float32, units)
    # the activations' peak: the first layer's weight gradient twice (the matmul's transposed layout and autograd's
    # copy) beside the loss and its gradient (test_step_memory's hand count)
    assert work.activations == 2 * w1 + 2 * F32
    # the most at one moment: when the first unit reduces, its gradient (alive once), its gathered weight, its
    # reduce-scatter input and its reduced shard, the second unit's shard (its copy may be pending), the loss and its
    # gradient; less than the two peaks added (FSDP2's own at that reduce is 4 w1 + w2 less the gradient)
    assert work.together == 4 * w1 + w2 + 2 * F32
    assert work.together < work.activations + (4 * w1 + w2)


def test_the_total_is_the_moment_where_traced_so_scaled_with_the_activations():
    apart = StepMemory(activations=10, gathered=6, batch="a batch of 4", samples=4)
    assert apart.total == 16
    traced = StepMemory(activations=10, gathered=6, batch="a batch of 4", samples=4, together=12)
    assert traced.total == 12
    assert StepMemory(activations=10, gathered=6, batch="b", together=5).total == 6  # never under FSDP2's own
    doubled = traced.at_samples(8)
    assert (doubled.activations, doubled.together, doubled.total) == (20, 22, 22)
    assert "at its peak (activations" in traced.describe()
