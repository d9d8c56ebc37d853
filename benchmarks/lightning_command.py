"""The Lightning peer of the `command` benchmark: the same work as plain_loop_torchrun.py, as a
Lightning user writes it: a LightningModule and `Trainer(devices=2, strategy="ddp")`, which
starts the second rank itself. No validation, checkpointing or progress bar; a CSV logger every
`warmup` steps. Rank 0 prints `samples_per_s=<steady rate after warm-up>`.

    python benchmarks/lightning_command.py --steps 160
"""

import os
import sys
import tempfile
import time

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from plain_loop_torchrun import SmallCNN, random_images, work_arguments  # (beside this script)
from torch.utils.data import DataLoader


class Timer(L.Callback):
    def __init__(self, warmup: int, total: int) -> None:
        self.warmup, self.total = warmup, total
        self.started = self.elapsed = None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.warmup:
            outputs["loss"].item()
            self.started = time.perf_counter()
        elif trainer.global_step == self.total:
            outputs["loss"].item()
            self.elapsed = time.perf_counter() - self.started


class Classifier(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.model, self.lr = SmallCNN(), lr

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = F.cross_entropy(self.model(inputs), targets)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=5e-4)


def main() -> None:
    args = work_arguments()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    data = random_images(args, world=2)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    timer = Timer(args.warmup, args.steps)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(bucket_cap_mb=25.0, gradient_as_bucket_view=True),
        max_steps=args.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=CSVLogger(tempfile.mkdtemp(prefix="lightning-bench-")),
        log_every_n_steps=args.warmup,
        callbacks=[timer],
    )
    trainer.fit(Classifier(args.lr), loader)
    if trainer.global_rank == 0:
        rate = (args.steps - args.warmup) * args.batch_size * 2 / timer.elapsed
        print(f"samples_per_s={rate:.1f}", flush=True)
    # As in plain_torchrun.py: torch 2.13 can deadlock freeing a DDP model at exit (seen here
    # too: a rank hung for minutes after fit). Both ranks leave without the interpreter's exit.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
