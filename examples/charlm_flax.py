"""A small byte-level transformer language model in Flax NNX.

Weights are stored in ``param_dtype`` (fp32, bf16 or fp16) and the math runs
in fp32 (``dtype=jnp.float32``, Flax's mixed-precision convention), so runs
that store weights in different precisions differ only in what the optimizer
can write into them. ``examples/charlm_torch.py`` is the same model in
PyTorch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 256
  context: int = 64
  d_model: int = 64
  heads: int = 4
  layers: int = 2


class Block(nnx.Module):
  """Pre-LayerNorm transformer block: causal self-attention, then a GELU MLP."""

  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    d, kw = cfg.d_model, dict(dtype=jnp.float32, rngs=rngs)
    self.heads = cfg.heads
    self.ln1 = nnx.LayerNorm(d, **kw)
    self.qkv = nnx.Linear(d, 3 * d, **kw)
    self.proj = nnx.Linear(d, d, **kw)
    self.ln2 = nnx.LayerNorm(d, **kw)
    self.fc = nnx.Linear(d, 4 * d, **kw)
    self.out = nnx.Linear(4 * d, d, **kw)

  def __call__(self, x):
    b, t, d = x.shape
    h = self.heads
    q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
    q, k, v = (a.reshape(b, t, h, d // h).transpose(0, 2, 1, 3) for a in (q, k, v))
    scores = q @ k.transpose(0, 1, 3, 2) * (d // h) ** -0.5
    causal = jnp.tril(jnp.ones((t, t), bool))
    attn = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    x = x + self.proj((attn @ v).transpose(0, 2, 1, 3).reshape(b, t, d))
    return x + self.out(jax.nn.gelu(self.fc(self.ln2(x)), approximate=True))


class CharTransformer(nnx.Module):
  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    kw = dict(dtype=jnp.float32, rngs=rngs)
    self.tok = nnx.Embed(cfg.vocab, cfg.d_model, **kw)
    self.pos = nnx.Embed(cfg.context, cfg.d_model, **kw)
    self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
    self.ln = nnx.LayerNorm(cfg.d_model, **kw)
    self.head = nnx.Linear(cfg.d_model, cfg.vocab, **kw)

  def __call__(self, tokens):
    x = self.tok(tokens) + self.pos(jnp.arange(tokens.shape[1]))
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln(x))  # fp32 logits


def create(cfg: Config, dtype=jnp.float32, seed: int = 0) -> CharTransformer:
  """The model with its weights drawn in fp32 from ``seed``, then stored in ``dtype``.

  Every run starts from the same fp32 draw, rounded once to its precision.
  """
  graphdef, params, rest = nnx.split(CharTransformer(cfg, nnx.Rngs(seed)), nnx.Param, ...)
  return nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(dtype), params), rest)


def loss_fn(model: CharTransformer, x, y):
  """Mean next-byte cross-entropy, in nats, in fp32."""
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
