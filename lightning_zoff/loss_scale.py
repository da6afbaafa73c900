"""Dynamic loss scaling for fp16: scale the loss up so small gradients survive fp16, skip steps that overflow."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class DynamicLossScaler:
    """On overflow the step is skipped; after `hysteresis` overflows in a row the scale is multiplied by
    `backoff_factor` (not below `min_scale`). After `growth_interval` good steps in a row it grows by
    `growth_factor`."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    good_steps: int = 0
    overflows_left: int = -1  # overflows still tolerated before backing off; -1: not started

    def __post_init__(self) -> None:
        if not (self.growth_factor > 1 and 0 < self.backoff_factor < 1 and self.growth_interval > 0
                and self.hysteresis >= 1 and 0 < self.min_scale <= self.scale):
            raise ValueError(
                "DynamicLossScaler needs growth_factor > 1, 0 < backoff_factor < 1, growth_interval > 0,"
                f" hysteresis >= 1 and 0 < min_scale <= scale; got {asdict(self)}"
            )
        if self.overflows_left < 0:
            self.overflows_left = self.hysteresis

    def update(self, overflow: bool) -> None:
        if overflow:
            self.good_steps = 0
            self.overflows_left -= 1
            if self.overflows_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
                self.overflows_left = self.hysteresis
            return
        self.good_steps += 1
        self.overflows_left = self.hysteresis
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
