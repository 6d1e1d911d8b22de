"""optax_half: train bf16/fp16 params without losing accuracy, in Optax.

Wrappers (any optax transformation on 16-bit params): master_weights,
  kahan_summation, stochastic_rounding, round_to_nearest; built from them:
  adam_fp32_master, adamw_bf16. fp16 loss scaling: dynamic_loss_scale,
  scale_loss, loss_scale, value_and_scaled_grad. ScaledAdam (icefall):
  scaled_adam, scaled_adam_stats, eden. Schedules: preheat_decay_schedule, eden.
Gradient clipping (optax's, no fp32 copy of 16-bit gradients): clip_by_global_norm.
In place (the native kernel, on CPU): update_and_apply, chain (optax.chain, in
  place through its last element). flat_state=False <-> True: relayout_state.
Checkpoints (Orbax, checked leaf by leaf): checkpoint.save, checkpoint.restore.
jmp's API (``import optax_half as jmp`` ports jmp code): Policy, get_policy,
  cast_to_full, cast_to_half, half_dtype; DynamicLossScale, StaticLossScale,
  NoOpLossScale, LossScale, all_finite, select_tree; nnx.apply_policy.
"""

from optax_half import checkpoint, rounding
from optax_half._flat import relayout_state
from optax_half._in_place import chain, update_and_apply
from optax_half.clipping import clip_by_global_norm
from optax_half.adam import ScaleByAdamWState, adam_fp32_master, adamw_bf16, scale_by_adamw
from optax_half.loss_scale import (
    DynamicLossScale,
    DynamicLossScaleState,
    LossScale,  # noqa: F401 (see below)
    NoOpLossScale,
    NotABooleanScalar,
    StaticLossScale,
    all_finite,
    dynamic_loss_scale,
    find_loss_scale_state,
    loss_scale,
    scale_loss,
    select_tree,
    value_and_scaled_grad,
)
from optax_half.policy import Policy, cast_to_full, cast_to_half, get_policy, half_dtype
from optax_half.scaled_adam import (
    ScaledAdamClippingState,
    ScaledAdamState,
    scaled_adam,
    scaled_adam_stats,
)
from optax_half.schedules import eden, preheat_decay_schedule
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


# LossScale (jmp's union of the loss-scale classes) is importable but, a type alias with no
# docstring of its own, not in __all__.


def __getattr__(name):
  # nnx and train_state need Flax: imported on first use, not with the package.
  if name in ("nnx", "train_state"):
    import importlib  # noqa: PLC0415
    return importlib.import_module(f"optax_half.{name}")
  raise AttributeError(f"module 'optax_half' has no attribute {name!r}")


__all__ = [
    "adam_fp32_master",
    "adamw_bf16",
    "all_finite",
    "cast_to_full",
    "cast_to_half",
    "chain",
    "checkpoint",
    "clip_by_global_norm",
    "dynamic_loss_scale",
    "eden",
    "find_loss_scale_state",
    "get_policy",
    "half_dtype",
    "kahan_summation",
    "loss_scale",
    "master_weights",
    "preheat_decay_schedule",
    "relayout_state",
    "round_to_nearest",
    "rounding",
    "scale_by_adamw",
    "scale_loss",
    "scaled_adam",
    "scaled_adam_stats",
    "select_tree",
    "stochastic_rounding",
    "update_and_apply",
    "value_and_scaled_grad",
    "DynamicLossScale",
    "DynamicLossScaleState",
    "KahanSummationState",
    "MasterWeightsState",
    "NoOpLossScale",
    "NotABooleanScalar",
    "Policy",
    "RoundToNearestState",
    "ScaleByAdamWState",
    "ScaledAdamClippingState",
    "ScaledAdamState",
    "StaticLossScale",
    "StochasticRoundingState",
]
