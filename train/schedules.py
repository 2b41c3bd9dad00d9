"""Step -> multiplier schedules of a run (all pure functions of the step, so resuming needs no state)."""

import math


def lr_multiplier(step: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to min_ratio at max_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def ramp(step: int, steps: int) -> float:
    """0 -> 1 linearly over `steps` steps (1 from the start when steps == 0)."""
    return 1.0 if steps <= 0 else min(1.0, step / steps)
