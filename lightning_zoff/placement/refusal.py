"""A plan that does not fit the machine is refused before anything is allocated: `PlanDoesNotFit`, whose message gives
what the plan needs on each side, what the machine keeps for the rest of the process tree, and the options that would
fit (the policy checks them: `policy.options_that_fit`)."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_zoff.placement.machine import HOST_RESERVE, LOADER_WORKER_BYTES, size
from lightning_zoff.placement.plan import MemoryPlan, host_bytes_per_element


class PlanDoesNotFit(MemoryError):
    """The model's state does not fit this machine with these options; the message says what would."""


def refusal(plan: MemoryPlan, problems: list[str], fits: Sequence[tuple[str, MemoryPlan]], masters_bytes: int) -> str:
    """The message of a plan that does not fit: what it needs where (`problems`), and the options that would fit, each
    with its plan (`fits`)."""
    options = plan.options
    trained = sum(s.trained for s in plan.shapes)
    needs = (f"zoff: the optimizer state of {trained:,} trained elements on this rank does not fit "
             + " and ".join(problems) + f" (host: {size(plan.machine.host_available)} available at setup, of which"
             f" {size(plan.machine.host_kept)} stays with the rest of the process tree: {HOST_RESERVE:.0%} or at least"
             f" 0.25 GiB, and {size(LOADER_WORKER_BYTES)} for each of {plan.machine.loader_workers} loader workers;"
             f" {host_bytes_per_element(options)} B per element on the host, {options.state_bytes(1)} on the"
             " accelerator).")
    listed = "; ".join(f"{option}: {_to_spare(fit, masters_bytes)}" for option, fit in fits)
    text = "Options that fit (checked by the plan): " + listed + ". " if fits else ""
    if plan.step is None:
        beyond = ("Beyond the plan, which counts no activations: activation checkpointing"
                  " (ZoffStrategy(activation_checkpointing_policy={YourBlock})) and a smaller batch leave the"
                  " accelerator more room for state; more ranks (GPUs or nodes) split the state among them.")
    else:
        beyond = ("Beyond these: a shorter sequence leaves the step less to hold; more ranks (GPUs or nodes) split the"
                  " state among them.")
    return needs + " " + text + beyond


def _to_spare(plan: MemoryPlan, masters_bytes: int) -> str:
    """What a plan that fits leaves free on each side."""
    host = plan.machine.host_capacity - plan.host_setup_peak(masters_bytes)
    text = f"fits with {size(host)} to spare on the host"
    capacity = plan.machine.accelerator_capacity
    if capacity is not None:
        step = "before activations" if plan.step is None else "at the step's peak"
        text += f" and {size(capacity - plan.accelerator_need)} on the accelerator {step}"
    return text
