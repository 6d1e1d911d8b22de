"""optax_half: train bf16/fp16 params without losing accuracy, in Optax.

Composable wrappers (any optax transformation on 16-bit params):
  master_weights, kahan_summation, stochastic_rounding, round_to_nearest
Named optimizers built from them:
  adam_fp32_master, adamw_bf16
Schedules:
  preheat_decay_schedule
"""

from optax_half import rounding
from optax_half.adam import ScaleByAdamWState, adam_fp32_master, adamw_bf16, scale_by_adamw
from optax_half.schedules import preheat_decay_schedule
from optax_half.wrappers import (
    KahanSummationState,
    MasterWeightsState,
    RoundToNearestState,
    StochasticRoundingState,
    kahan_summation,
    master_weights,
    round_to_nearest,
    stochastic_rounding,
)

__version__ = "0.1.0"

__all__ = [
    "adam_fp32_master",
    "adamw_bf16",
    "kahan_summation",
    "master_weights",
    "preheat_decay_schedule",
    "round_to_nearest",
    "rounding",
    "scale_by_adamw",
    "stochastic_rounding",
    "KahanSummationState",
    "MasterWeightsState",
    "RoundToNearestState",
    "ScaleByAdamWState",
    "StochasticRoundingState",
]
