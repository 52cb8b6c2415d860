"""The trainer callbacks drive a worker from real Trainers' hooks, in this process, with no coordinator.

Each callback's ``attached`` (the ``AttachedWorker`` that would join a run) is
swapped for a recording stub, and a real Hugging Face ``Trainer`` or Lightning
``Trainer`` trains a tiny model on CPU. What the stub saw proves the contract:
``start`` once, with the trainer's model and its optimizer, before any step;
one ``optimizer_step`` per *optimizer* step, not per micro-batch of gradient
accumulation, with the tokens that step trained on; the trainer stops at the
step where the run says stop; ``finish`` at the end, also when Lightning's
training raises; more than one Lightning optimizer is refused. The last part
checks ``AttachedWorker`` itself with the ``diloco.Worker`` it builds replaced:
its argument checks, its no-ops before joining, and its token sums.
"""

from __future__ import annotations

import pytest
import torch

from diloco.integrations.attached import AttachedWorker


class RecordingAttached:
    """Stands in for ``AttachedWorker``: records every call in ``calls``; the ``stop_at``-th
    ``optimizer_step`` returns False (the run said stop). ``add_tokens`` sums as the real one does:
    an ``optimizer_step`` without tokens takes the sum since the previous step (``per_step``)."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.calls: list[tuple] = []
        self.stop_at = stop_at
        self.steps = 0
        self.per_step: list[int | None] = []
        self._pending: int | None = None
        self.worker = None

    def start(self, model, optimizer) -> None:
        self.calls.append(("start", model, optimizer))

    def add_tokens(self, n: int) -> None:
        self.calls.append(("add_tokens", n))
        self._pending = (self._pending or 0) + int(n)

    def optimizer_step(self, tokens: int | None = None) -> bool:
        self.calls.append(("optimizer_step", tokens))
        if tokens is None:
            tokens, self._pending = self._pending, None
        self.per_step.append(tokens)
        self.steps += 1
        return self.steps != self.stop_at

    def report(self, **figures) -> None:
        self.calls.append(("report", figures))

    def finish(self) -> None:
        self.calls.append(("finish",))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def of(self, name: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == name]


# ------------------------------------------------------------------ Hugging Face Trainer

SEQ, ROWS, ACCUMULATE = 16, 4, 2


def hf_trainer(tmp_path, stub, *, count_tokens: bool = True, max_steps: int = 6):
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from diloco.integrations.transformers import DilocoCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2))
    gen = torch.Generator().manual_seed(1)
    data = [{"input_ids": t, "labels": t} for t in torch.randint(0, 32, (48, SEQ), generator=gen)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=max_steps, gradient_accumulation_steps=ACCUMULATE,
                             per_device_train_batch_size=ROWS, report_to="none", save_strategy="no", use_cpu=True,
                             disable_tqdm=True, include_num_input_tokens_seen=count_tokens, logging_steps=2)
    cb = DilocoCallback(connect="tcp://127.0.0.1:1", sync_every=2)
    cb.attached = stub
    return Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]), cb


def test_hf_trainer_one_step_per_optimizer_step_with_its_tokens(tmp_path):
    stub = RecordingAttached()
    trainer, cb = hf_trainer(tmp_path, stub)
    trainer.train()
    names = stub.names()
    assert names.count("start") == 1 and names[0] == "start"  # before any step
    _, model, optimizer = stub.calls[0]
    assert model is trainer.model and optimizer is not None and optimizer is trainer.optimizer
    # 6 optimizer steps; the 12 micro-batches of gradient accumulation are not steps.
    assert trainer.state.global_step == 6 and len(stub.of("optimizer_step")) == 6
    # include_num_input_tokens_seen=True is "all" in transformers 5: each micro-batch adds
    # inputs["input_ids"].numel() (labels not counted), so one optimizer step trained on
    # 2 micro-batches x 4 rows x 16 tokens.
    assert [c[1] for c in stub.of("optimizer_step")] == [ACCUMULATE * ROWS * SEQ] * 6
    assert trainer.state.num_input_tokens_seen == 6 * ACCUMULATE * ROWS * SEQ
    assert names[-1] == "finish" and names.count("finish") == 1
    # The logged loss reaches the worker (logging_steps=2: at steps 2, 4, 6).
    losses = [c[1]["loss"] for c in stub.of("report") if c[1].get("loss") is not None]
    assert len(losses) == 3 and all(loss > 0 for loss in losses)
    assert cb.worker is None  # the stub's: no worker joined


def test_hf_trainer_stops_at_the_step_the_run_says_stop(tmp_path):
    stub = RecordingAttached(stop_at=3)
    trainer, _ = hf_trainer(tmp_path, stub, max_steps=20)
    trainer.train()
    assert trainer.state.global_step == 3
    assert len(stub.of("optimizer_step")) == 3
    assert stub.names()[-1] == "finish" and stub.names().count("finish") == 1


def test_hf_trainer_without_token_counting_passes_no_tokens(tmp_path):
    stub = RecordingAttached()
    trainer, _ = hf_trainer(tmp_path, stub, count_tokens=False, max_steps=3)
    trainer.train()
    assert [c[1] for c in stub.of("optimizer_step")] == [None, None, None]
    assert stub.of("add_tokens") == []


# ------------------------------------------------------------------ Lightning Trainer

BATCHES, BATCH_ROWS = 24, 2


def lightning_run(stub, module, *, max_steps: int = 5, accumulate: int = 3):
    L = pytest.importorskip("lightning")
    from torch.utils.data import DataLoader, TensorDataset

    from diloco.integrations.lightning import DilocoCallback

    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(BATCHES * BATCH_ROWS, 4, generator=gen),
                         torch.randn(BATCHES * BATCH_ROWS, 1, generator=gen))
    loader = DataLoader(data, batch_size=BATCH_ROWS)
    cb = DilocoCallback(connect="tcp://127.0.0.1:1", sync_every=1, tokens_of=lambda batch: batch[0].shape[0])
    cb.attached = stub
    trainer = L.Trainer(max_steps=max_steps, accumulate_grad_batches=accumulate, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[cb])
    return trainer, loader


def tiny_module(*, raise_at: int | None = None, optimizers: int = 1):
    L = pytest.importorskip("lightning")

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 1)
            self.optimizers_made: list = []
            if optimizers > 1:
                # Lightning itself refuses several optimizers under automatic optimization,
                # before any callback runs: manual optimization lets the callback's check speak.
                self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            if batch_idx == raise_at:
                raise ValueError(f"boom at batch {batch_idx}")
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("loss", loss)
            if not self.automatic_optimization:
                return None
            return loss

        def configure_optimizers(self):
            self.optimizers_made = [torch.optim.SGD(self.parameters(), lr=0.01) for _ in range(optimizers)]
            return self.optimizers_made if optimizers > 1 else self.optimizers_made[0]

    return Tiny()


def test_lightning_one_step_per_optimizer_step_and_tokens_per_batch():
    stub = RecordingAttached()
    module = tiny_module()
    trainer, loader = lightning_run(stub, module)
    trainer.fit(module, loader)
    names = stub.names()
    assert names[0] == "start" and names.count("start") == 1
    _, model, optimizer = stub.calls[0]
    assert model is module and trainer.optimizers == [optimizer]
    assert optimizer is module.optimizers_made[0]
    # 5 optimizer steps of 3 micro-batches: 15 batches counted, 5 steps.
    assert trainer.global_step == 5
    assert len(stub.of("optimizer_step")) == 5 and len(stub.of("add_tokens")) == 15
    assert [c[1] for c in stub.of("add_tokens")] == [BATCH_ROWS] * 15
    # Each step takes the tokens of its own 3 micro-batches (the sum add_tokens built since the last step).
    assert stub.per_step == [3 * BATCH_ROWS] * 5
    assert len(stub.of("report")) == 5 and all(c[1]["loss"] >= 0 for c in stub.of("report"))
    assert names[-1] == "finish" and names.count("finish") == 1


def test_lightning_stops_at_the_step_the_run_says_stop():
    stub = RecordingAttached(stop_at=2)
    module = tiny_module()
    trainer, loader = lightning_run(stub, module, max_steps=20)
    trainer.fit(module, loader)
    assert trainer.global_step == 2 and len(stub.of("optimizer_step")) == 2
    assert len(stub.of("add_tokens")) == 6  # no batch trained after the stop
    assert stub.names()[-1] == "finish"


def test_lightning_leaves_when_training_raises():
    stub = RecordingAttached()
    module = tiny_module(raise_at=4)
    trainer, loader = lightning_run(stub, module)
    with pytest.raises(ValueError, match="boom at batch 4"):
        trainer.fit(module, loader)
    assert len(stub.of("optimizer_step")) == 1  # batches 0-2 made step 1; batch 3 counted, 4 raised
    assert len(stub.of("add_tokens")) == 4
    assert stub.names()[-1] == "finish" and stub.names().count("finish") == 1  # on_exception


def test_lightning_refuses_two_optimizers_before_joining():
    stub = RecordingAttached()
    module = tiny_module(optimizers=2)
    trainer, loader = lightning_run(stub, module, accumulate=1)  # manual optimization accumulates nothing
    with pytest.raises(RuntimeError, match=r"exactly one optimizer \(configure_optimizers returned 2\)"):
        trainer.fit(module, loader)
    assert stub.of("start") == [] and stub.of("optimizer_step") == []


# ------------------------------------------------------------------ AttachedWorker itself


class FakeWorker:
    """Stands in for ``diloco.Worker`` inside ``AttachedWorker.start``: records what it is given."""

    made: list["FakeWorker"] = []

    def __init__(self, model, optimizer, **kwargs) -> None:
        self.model, self.optimizer, self.kwargs = model, optimizer, kwargs
        self.entered = self.closed = 0
        self.stopped = False
        self.steps: list[int | None] = []
        self.reports: list[dict] = []
        FakeWorker.made.append(self)

    def __enter__(self):
        self.entered += 1
        return self

    def step(self, tokens=None) -> bool:
        self.steps.append(tokens)
        return True

    def report(self, **figures) -> None:
        self.reports.append(figures)

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def fake_worker(monkeypatch):
    import diloco.integrations.attached as attached

    FakeWorker.made = []
    monkeypatch.setattr(attached, "Worker", FakeWorker)
    return FakeWorker


def model_and_optimizer():
    model = torch.nn.Linear(2, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("sync_every", [0, -1, True, 2.5, "4", None])
def test_sync_every_must_be_a_whole_number_of_steps(sync_every):
    with pytest.raises(ValueError, match="sync_every=.*expected a whole number of optimizer steps >= 1"):
        AttachedWorker(connect="tcp://127.0.0.1:1", sync_every=sync_every)


def test_before_start_nothing_happens_and_no_worker_exists(fake_worker):
    aw = AttachedWorker(connect="tcp://127.0.0.1:1", sync_every=2)
    assert not aw.joined and aw.worker is None
    assert aw.optimizer_step() is False and aw.optimizer_step(10) is False
    aw.report(loss=1.0)
    aw.finish()  # a no-op
    with pytest.raises(AttributeError, match="no worker yet"):
        aw.rounds_synced
    assert fake_worker.made == []


def test_start_joins_once_and_finish_leaves_once(fake_worker):
    aw = AttachedWorker(connect="tcp://127.0.0.1:1", sync_every=3, worker_id="w7")
    with pytest.raises(RuntimeError, match="no model or no optimizer"):
        aw.start(torch.nn.Linear(2, 1), None)
    model, opt = model_and_optimizer()
    aw.start(model, opt)
    aw.start(model, opt)  # a second train() while joined keeps the worker
    (w,) = fake_worker.made
    assert w.model is model and w.optimizer is opt and w.entered == 1 and aw.joined
    assert w.kwargs["sync_every"] == 3 and w.kwargs["worker_id"] == "w7" and w.kwargs["connect"] == "tcp://127.0.0.1:1"
    aw.report(loss=2.0, eval_loss=None, learning_rate=0.1)
    assert w.reports == [{"loss": 2.0}]  # unknown names and Nones dropped
    aw.finish()
    aw.finish()
    assert w.closed == 1 and not aw.joined and aw.worker is w
    assert aw.optimizer_step() is False and w.steps == []


def test_add_tokens_sums_until_an_optimizer_step_takes_them(fake_worker):
    aw = AttachedWorker(connect="tcp://127.0.0.1:1", sync_every=2)
    aw.start(*model_and_optimizer())
    (w,) = fake_worker.made
    aw.add_tokens(3)
    aw.add_tokens(4)
    assert aw.optimizer_step() is True
    assert aw.optimizer_step() is True  # nothing counted since: None (the step counts one)
    aw.add_tokens(5)
    assert aw.optimizer_step() is True
    assert w.steps == [7, None, 5]
    w.stopped = True  # the run told the worker to stop
    assert aw.optimizer_step(9) is False and w.steps == [7, None, 5]
    aw.finish()
