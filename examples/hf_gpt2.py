"""A small GPT-2 from ``transformers``, trained by the Hugging Face ``Trainer`` as one DiLoCo worker.

Nothing is downloaded: the model is built from a ``GPT2Config`` (randomly
initialised from seed 0, so every worker starts from the same weights) with a
byte-level vocabulary of 256 (no tokenizer to fetch), and the data is diloco's
built-in corpus (the Python standard library's own source text). Run a
coordinator, then this script once per worker::

    diloco server --min-workers 2 --checkpoint-dir ckpt &
    python examples/hf_gpt2.py --worker-id w1 &
    python examples/hf_gpt2.py --worker-id w2

Each prints the held-out loss before and after and one ``RESULT`` line. Then
``diloco export ckpt out/`` writes the run's params as ``out/model.safetensors``;
with the config beside it (``make_config().save_pretrained("out")``),
``GPT2LMHeadModel.from_pretrained("out")`` loads the trained model.

The same model runs under ``diloco worker`` too (its own loop, no Trainer)::

    diloco worker --entry examples/hf_gpt2.py:make_setup
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from diloco.data import BatchSampler, Corpus, derive_seed
from diloco.integrations.transformers import DilocoCallback
from diloco.worker import TrainingSetup

SEQ_LEN = 64
BATCH_SIZE = 8
LR = 3e-3
CORPUS_BYTES = 1_000_000


def make_config() -> GPT2Config:
    """A 2-layer GPT-2 over bytes: about 120k parameters."""
    return GPT2Config(vocab_size=256, n_positions=SEQ_LEN, n_embd=64, n_layer=2, n_head=2,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)


def make_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)  # every worker builds the same initial weights
    return GPT2LMHeadModel(make_config())


class ByteWindows(torch.utils.data.Dataset):
    """``count`` windows of ``SEQ_LEN`` bytes drawn from ``tokens`` by a seeded generator."""

    def __init__(self, tokens: torch.Tensor, count: int, seed: int) -> None:
        sampler = BatchSampler(tokens, count, SEQ_LEN, seed=seed)
        self.windows = sampler.next()[0]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict:
        ids = self.windows[i]
        return {"input_ids": ids, "labels": ids}  # the model shifts the labels itself


def held_out_loss(model: GPT2LMHeadModel) -> float:
    """Mean next-byte loss on 64 fixed windows of the corpus's held-out part (the same for every worker)."""
    corpus = Corpus.from_stdlib(max_bytes=CORPUS_BYTES)
    ids = ByteWindows(corpus.eval, 64, derive_seed(0, "eval") % 2**31).windows
    was_training = model.training
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    model.train(was_training)
    return loss


def make_trainer(worker_id: str, *, connect: str, sync_every: int, steps: int, out_dir: str,
                 grad_accum: int = 1, **diloco_options) -> Trainer:
    """A Trainer for this worker's shard, with ``DilocoCallback`` making it a worker of the run."""
    corpus = Corpus.from_stdlib(max_bytes=CORPUS_BYTES)
    seed = derive_seed(0, "worker", worker_id) % 2**31  # each worker its own windows and order
    train = ByteWindows(corpus.train, steps * grad_accum * BATCH_SIZE, seed)
    args = TrainingArguments(
        output_dir=out_dir, max_steps=steps, per_device_train_batch_size=BATCH_SIZE,
        gradient_accumulation_steps=grad_accum, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, logging_steps=10,
        save_strategy="no", report_to="none", use_cpu=True, seed=seed, dataloader_num_workers=0,
        include_num_input_tokens_seen=True, disable_tqdm=True)
    callback = DilocoCallback(connect=connect, sync_every=sync_every, worker_id=worker_id, **diloco_options)
    return Trainer(model=make_model(), args=args, train_dataset=train, callbacks=[callback])


def make_setup(worker_id: str = "worker") -> TrainingSetup:
    """The same model for ``diloco worker --entry examples/hf_gpt2.py:make_setup`` (diloco's own loop)."""
    corpus = Corpus.from_stdlib(max_bytes=CORPUS_BYTES)
    model = make_model()
    batches = BatchSampler(corpus.train, BATCH_SIZE, SEQ_LEN, seed=derive_seed(0, "worker", worker_id))
    return TrainingSetup(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR), batches=batches,
                         loss_fn=lambda m, batch: m(input_ids=batch[0], labels=batch[0]).loss,
                         tokens_of=lambda batch: batch[0].numel())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Train a small GPT-2 with the Hugging Face Trainer as one DiLoCo worker.")
    p.add_argument("--connect", default="tcp://127.0.0.1:5555", help="the coordinator (default tcp://127.0.0.1:5555)")
    p.add_argument("--worker-id", default=f"gpt2-{os.getpid()}", help="this worker's id (default gpt2-PID)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    p.add_argument("--sync-every", type=int, default=20, help="optimizer steps per round, H (default 20)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--out", default=None, help="the Trainer's output_dir (default: a temporary directory)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = make_trainer(args.worker_id, connect=args.connect, sync_every=args.sync_every, steps=args.steps,
                               out_dir=args.out or tmp, grad_accum=args.grad_accum)
        before = held_out_loss(trainer.model)
        trainer.train()
        after = held_out_loss(trainer.model)
    worker = next(c for c in trainer.callback_handler.callbacks if isinstance(c, DilocoCallback)).worker
    print(f"RESULT hf_gpt2 worker={args.worker_id} eval_loss_before={before:.4f} eval_loss_after={after:.4f} "
          f"inner_steps={worker.inner_step} rounds_synced={worker.rounds_synced} stop_reason={worker.stop_reason}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
