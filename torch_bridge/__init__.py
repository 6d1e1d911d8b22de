"""torch_bridge: optax_half's low-precision optimizers for PyTorch.

The same names, keywords, defaults and numbers as ``optax_half``, as
``torch.optim.Optimizer`` objects (params first):

Wrappers around any torch optimizer:
  master_weights, kahan_summation, stochastic_rounding, round_to_nearest
Native optimizers:
  adam_fp32_master, adamw_bf16, scale_by_adamw
Dynamic loss scaling (a GradScaler-like object):
  dynamic_loss_scale
ScaledAdam (icefall) and its schedule:
  scaled_adam, scaled_adam_stats, eden (and the EdenLR scheduler)
Schedules:
  preheat_decay_schedule, eden
Bit-level primitives shared with JAX: ``torch_bridge.rounding``.
"""

from torch_bridge import rounding
from torch_bridge.accumulation import FP32Accumulation, accumulate_in_fp32
from torch_bridge.adam import LowPrecisionAdamW, adam_fp32_master, adamw_bf16, scale_by_adamw
from torch_bridge.loss_scale import DynamicLossScaler, dynamic_loss_scale
from torch_bridge.scaled_adam import ScaledAdam, scaled_adam, scaled_adam_stats
from torch_bridge.schedules import Eden, EdenLR, PreheatDecaySchedule, eden, preheat_decay_schedule
from torch_bridge.wrappers import (
    LowPrecisionWrapper,
    kahan_summation,
    master_weights,
    round_to_nearest,
    stochastic_rounding,
)

__all__ = [
    "accumulate_in_fp32",
    "adam_fp32_master",
    "adamw_bf16",
    "dynamic_loss_scale",
    "eden",
    "kahan_summation",
    "master_weights",
    "preheat_decay_schedule",
    "round_to_nearest",
    "rounding",
    "scale_by_adamw",
    "scaled_adam",
    "scaled_adam_stats",
    "stochastic_rounding",
    "DynamicLossScaler",
    "Eden",
    "EdenLR",
    "FP32Accumulation",
    "LowPrecisionAdamW",
    "LowPrecisionWrapper",
    "PreheatDecaySchedule",
    "ScaledAdam",
]
