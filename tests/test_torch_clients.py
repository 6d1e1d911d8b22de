"""torch_bridge inside the training frameworks that call its optimizers.

PyTorch Lightning (``precision="bf16-true"``), the Hugging Face ``Trainer``
and accelerate, each with ``tb.adamw_bf16`` on bf16 params, fp32 gradient
accumulation (``accumulate_in_fp32``), the framework's own micro-batching and
gradient clipping (which calls ``torch.nn.utils.clip_grad_norm_``), and a
checkpoint resume compared bit for bit with the uninterrupted run. Marker
``slow`` (``make test-slow``); the clients are the optional extra ``clients``
(``pip install -e ".[clients]"``), and each test is skipped without its client.
Nothing is downloaded: the models are built from local configs.
"""

import os

import pytest

torch = pytest.importorskip("torch")

import torch_bridge as tb  # noqa: E402

pytestmark = pytest.mark.slow
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _client(name):
  return pytest.importorskip(
      name, reason=f"{name} is not installed (the optional extra: pip install -e '.[clients]')")


def _bytes_dataset(n, length):
  """``n`` windows of ``length + 1`` bytes of this file, as int64 token ids."""
  with open(__file__, "rb") as f:
    data = torch.tensor(list(f.read()), dtype=torch.int64)
  starts = torch.arange(n) * 97 % (len(data) - length - 1)
  return torch.stack([data[s:s + length + 1] for s in starts.tolist()])


def _bits(module):
  return [p.detach().clone() for p in module.parameters()]


def _equal(a, b):
  return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _decreasing(losses):
  """Finite, and the mean of the last quarter below the mean of the first."""
  losses = [float(x) for x in losses]
  q = max(1, len(losses) // 4)
  return (all(torch.isfinite(torch.tensor(losses)))
          and sum(losses[-q:]) / q < sum(losses[:q]) / q)


# ---------------------------------------------------------------------------
# PyTorch Lightning.
# ---------------------------------------------------------------------------


def _lightning_run(tmp_path, max_epochs, clip, ckpt_in=None, ckpt_out=None):
  pl = _client("pytorch_lightning")
  data = _bytes_dataset(16, 16)

  class ByteLM(pl.LightningModule):
    def __init__(self):
      super().__init__()
      torch.manual_seed(0)
      self.embed = torch.nn.Embedding(256, 32)
      self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                     torch.nn.Linear(64, 256))
      self.losses = []

    def training_step(self, batch, _):
      (x,) = batch
      logits = self.mlp(self.embed(x[:, :-1])).float()
      loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1))
      self.losses.append(loss.detach())
      return loss

    def configure_optimizers(self):
      assert all(p.dtype == torch.bfloat16 for p in self.parameters())  # bf16-true
      self.handle = tb.accumulate_in_fp32(self.parameters())
      return tb.adamw_bf16(self.parameters(), lr=3e-3)

  model = ByteLM()
  loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)
  trainer = pl.Trainer(
      accelerator="cpu", devices=1, precision="bf16-true", max_epochs=max_epochs,
      accumulate_grad_batches=2, gradient_clip_val=clip, logger=False,
      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
      default_root_dir=str(tmp_path), deterministic=True)
  trainer.fit(model, loader, ckpt_path=ckpt_in)
  assert len(model.handle.params) == 5 and trainer.global_step == 2 * max_epochs
  if ckpt_out is not None:
    trainer.save_checkpoint(ckpt_out)
  return model


def test_lightning_bf16_true_clipping_accumulation_and_resume(tmp_path):
  """4 micro-batches an epoch, 2 a step; resumed at an epoch boundary it ends
  where the uninterrupted run does, bit for bit, and the clip changes the run."""
  full = _lightning_run(tmp_path / "a", max_epochs=6, clip=0.5)
  assert _decreasing(full.losses)
  ckpt = str(tmp_path / "half.ckpt")
  _lightning_run(tmp_path / "b", max_epochs=3, clip=0.5, ckpt_out=ckpt)
  resumed = _lightning_run(tmp_path / "c", max_epochs=6, clip=0.5, ckpt_in=ckpt)
  assert _equal(_bits(full), _bits(resumed))
  unclipped = _lightning_run(tmp_path / "d", max_epochs=6, clip=None)
  assert not _equal(_bits(full), _bits(unclipped))


# ---------------------------------------------------------------------------
# Hugging Face transformers' Trainer.
# ---------------------------------------------------------------------------


def _hf_run(tmp_path, max_steps, max_grad_norm, resume=None, save_steps=None):
  transformers = _client("transformers")
  _client("accelerate")
  config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2,
                                   n_head=2, bos_token_id=0, eos_token_id=0)
  torch.manual_seed(0)
  model = transformers.GPT2LMHeadModel(config).to(torch.bfloat16)
  handle = tb.accumulate_in_fp32(model.parameters())
  data = _bytes_dataset(16, 16)
  dataset = [{"input_ids": row, "labels": row} for row in data]
  args = transformers.TrainingArguments(
      output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=4,
      gradient_accumulation_steps=2, max_grad_norm=max_grad_norm, learning_rate=3e-3,
      lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, report_to=[],
      save_strategy="steps" if save_steps else "no", save_steps=save_steps or 1,
      use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
  opt = tb.adamw_bf16(model.parameters(), lr=3e-3)
  trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset,
                                 optimizers=(opt, None))
  trainer.train(resume_from_checkpoint=resume)
  handle.remove()
  logs = [r for r in trainer.state.log_history if "loss" in r]
  return model, logs


def test_hf_trainer_max_grad_norm_accumulation_and_resume(tmp_path):
  """A tiny GPT-2 (2 layers, width 32) in bf16 on byte tokens; the logged
  grad_norm is the fp32 sum's (not the 0 of an empty p.grad), the clip
  changes the run, and a resume from the step-4 checkpoint ends bit for bit
  where the uninterrupted run does."""
  full, logs = _hf_run(tmp_path / "a", max_steps=8, max_grad_norm=0.5, save_steps=4)
  assert _decreasing([r["loss"] for r in logs])
  norms = [float(r["grad_norm"]) for r in logs]
  assert all(n > 0.5 and torch.isfinite(torch.tensor(n)) for n in norms), norms
  resumed, _ = _hf_run(tmp_path / "b", max_steps=8, max_grad_norm=0.5,
                       resume=str(tmp_path / "a" / "checkpoint-4"))
  assert _equal(_bits(full), _bits(resumed))
  unclipped, _ = _hf_run(tmp_path / "c", max_steps=8, max_grad_norm=1e9)
  assert not _equal(_bits(full), _bits(unclipped))


# ---------------------------------------------------------------------------
# accelerate.
# ---------------------------------------------------------------------------


def _accelerate_run(tmp_path, steps, clip, save_at=None, load=None):
  accelerate = _client("accelerate")
  torch.manual_seed(0)
  model = torch.nn.Sequential(torch.nn.Embedding(256, 32), torch.nn.Linear(32, 64),
                              torch.nn.GELU(), torch.nn.Linear(64, 256)).to(torch.bfloat16)
  handle = tb.accumulate_in_fp32(model.parameters())
  opt = tb.adamw_bf16(model.parameters(), lr=3e-3)
  loader = torch.utils.data.DataLoader(_bytes_dataset(16, 16), batch_size=4)
  accelerator = accelerate.Accelerator(gradient_accumulation_steps=2, cpu=True)
  model, opt, loader = accelerator.prepare(model, opt, loader)
  if load is not None:
    accelerator.load_state(load)
  losses, norms, done = [], [], 0 if load is None else save_at
  while done < steps:
    for x in loader:
      with accelerator.accumulate(model):
        logits = model(x[:, :-1]).float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1))
        accelerator.backward(loss)
        if accelerator.sync_gradients:
          true_norm = torch.linalg.vector_norm(torch.stack(
              [torch.linalg.vector_norm(p.main_grad) for p in model.parameters()]))
          norms.append((accelerator.clip_grad_norm_(model.parameters(), clip), true_norm))
        opt.step()
        opt.zero_grad()
      losses.append(loss.detach())
      if accelerator.sync_gradients:
        done += 1
        if done == save_at and load is None:
          accelerator.save_state(str(tmp_path / "state"))
  handle.remove()
  return accelerator.unwrap_model(model), losses, norms


def test_accelerate_accumulate_clip_and_save_load_state(tmp_path):
  """accelerator.accumulate (2 micro-batches a step), clip_grad_norm_ on the
  fp32 sums, save_state at step 4 (an epoch boundary) and load_state: the
  resumed run ends bit for bit where the uninterrupted one does."""
  full, losses, norms = _accelerate_run(tmp_path / "a", steps=12, clip=0.1, save_at=4)
  assert _decreasing(losses)
  assert all(torch.equal(n, true) and float(n) > 0.1 for n, true in norms)  # the fp32 sums'
  resumed, _, _ = _accelerate_run(tmp_path / "b", steps=12, clip=0.1, save_at=4,
                                  load=str(tmp_path / "a" / "state"))
  assert _equal(_bits(full), _bits(resumed))
  unclipped, _, _ = _accelerate_run(tmp_path / "c", steps=12, clip=1e9)
  assert not _equal(_bits(full), _bits(unclipped))
