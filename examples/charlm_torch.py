"""The byte-level transformer of ``examples/charlm_flax.py``, in PyTorch.

Same architecture, same parameter layout and names (``blocks.0.qkv.weight``
is Flax's ``blocks[0].qkv.kernel``, transposed), and the same convention:
weights stored in the model's dtype, math in fp32 (each layer casts its
weights to the fp32 activations; their gradients come back in the weight
dtype). ``load_flax_params`` copies a Flax model's weights in through DLPack,
so both frameworks start from identical bits.
"""

from __future__ import annotations

import jax
import torch
import torch.nn.functional as F
from flax import nnx
from torch import nn

from charlm_flax import Config
from torch_bridge import dlpack


class Linear(nn.Linear):
  def forward(self, x):
    return F.linear(x, self.weight.to(x.dtype), self.bias.to(x.dtype))


class LayerNorm(nn.LayerNorm):
  def __init__(self, d):
    super().__init__(d, eps=1e-6)  # Flax's default epsilon

  def forward(self, x):
    return F.layer_norm(x, self.normalized_shape, self.weight.to(x.dtype),
                        self.bias.to(x.dtype), self.eps)


class Embedding(nn.Embedding):
  def forward(self, tokens):
    return F.embedding(tokens, self.weight.float())


class Block(nn.Module):
  def __init__(self, cfg: Config):
    super().__init__()
    d = cfg.d_model
    self.heads = cfg.heads
    self.ln1, self.qkv, self.proj = LayerNorm(d), Linear(d, 3 * d), Linear(d, d)
    self.ln2, self.fc, self.out = LayerNorm(d), Linear(d, 4 * d), Linear(4 * d, d)

  def forward(self, x):
    b, t, d = x.shape
    h = self.heads
    q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
    q, k, v = (a.reshape(b, t, h, d // h).transpose(1, 2) for a in (q, k, v))
    scores = q @ k.transpose(-1, -2) * (d // h) ** -0.5
    causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
    attn = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))
    return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class CharTransformer(nn.Module):
  def __init__(self, cfg: Config):
    super().__init__()
    self.tok = Embedding(cfg.vocab, cfg.d_model)
    self.pos = Embedding(cfg.context, cfg.d_model)
    self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
    self.ln = LayerNorm(cfg.d_model)
    self.head = Linear(cfg.d_model, cfg.vocab)

  def forward(self, tokens):
    x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln(x))  # fp32 logits


def loss_fn(model: CharTransformer, x, y):
  """Mean next-byte cross-entropy, in nats, in fp32."""
  logits = model(x)
  return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


_TORCH_NAME = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}


@torch.no_grad()
def load_flax_params(model: CharTransformer, params) -> None:
  """Copies an ``nnx.Param`` state of ``charlm_flax.CharTransformer`` into ``model``.

  Each JAX array is viewed by torch through DLPack without a copy, then
  copied (cast to the torch param's dtype) into the torch parameter; Flax
  kernels are ``(in, out)``, torch weights ``(out, in)``.
  """
  named = dict(model.named_parameters())
  flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]
  if len(flat) != len(named):
    raise ValueError(f"{len(flat)} Flax params for {len(named)} torch params")
  for path, leaf in flat:
    keys = [str(k.key) for k in path]
    name = ".".join(keys[:-1] + [_TORCH_NAME[keys[-1]]])
    view = dlpack.to_torch(leaf)
    view = view.T if keys[-1] == "kernel" else view
    if view.shape != named[name].shape:  # copy_ would broadcast
      raise ValueError(f"{name}: Flax {tuple(view.shape)} vs torch {tuple(named[name].shape)}")
    named[name].copy_(view)
