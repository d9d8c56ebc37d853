"""The one training loop: fit() -> train_step() / evaluate() -> metric sinks."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import DataLoader
from tqdm import tqdm

from framework.checkpoint import Checkpointer, check_model_keys, restore_rng, rng_state
from framework.comm import Comm
from framework.data import ResumableSampler
from framework.distributed import DistEnv, all_reduce_sum
from framework.metrics import MetricSink
from framework.precision import Precision
from framework.stopping import NonFiniteLoss, StepAgreement, StopRun, Verdict

log = logging.getLogger("framework")


@dataclass
class TrainState:
    """Everything that advances as training goes; small and explicit."""

    step: int = 0
    epoch: int = 0
    samples_seen: int = 0
    train_seconds: float = 0.0
    nonfinite_skipped: int = 0


def micro_batch_groups(loader: Iterable, size: int) -> Iterator[list]:
    """Consecutive groups of `size` micro-batches; a short tail group is dropped."""
    iterator = iter(loader)
    while len(group := list(itertools.islice(iterator, size))) == size:
        yield group


class Runner:
    def __init__(
        self,
        *,
        env: DistEnv,
        device: torch.device,
        model: nn.Module,  # what forward/backward run on (DDP-wrapped when distributed)
        module: nn.Module,  # the bare model under it
        optimizer: Optimizer,
        scheduler: LRScheduler,
        precision: Precision,
        comm: Comm,
        train_loader: DataLoader,
        train_sampler: ResumableSampler,
        val_loader: DataLoader,
        sink: MetricSink,
        trainer_cfg: Any,
        global_batch_size: int,
        agreement: StepAgreement,
        checkpointer: Checkpointer,
        ema: AveragedModel | None = None,
    ) -> None:
        self.env, self.device = env, device
        self.model, self.module, self.ema = model, module, ema
        self.params = list(module.parameters())  # walked every step: listed once
        self.optimizer, self.scheduler = optimizer, scheduler
        self.precision, self.comm = precision, comm
        self.train_loader, self.train_sampler, self.val_loader = (
            train_loader,
            train_sampler,
            val_loader,
        )
        # A plain namespace: the loop reads these keys every step, and an OmegaConf attribute
        # read costs ~10 us (1.5% of a digits step, profiled with py-spy).
        if isinstance(trainer_cfg, DictConfig):
            trainer_cfg = SimpleNamespace(**OmegaConf.to_container(trainer_cfg, resolve=True))
        self.sink, self.cfg = sink, trainer_cfg
        self.global_batch_size = global_batch_size
        self.steps_per_epoch = len(train_loader) // trainer_cfg.grad_accum
        self.total_steps = planned_steps(trainer_cfg, self.steps_per_epoch)
        self.agreement, self.checkpointer = agreement, checkpointer
        self.state = TrainState()
        self.window = _Window(device)
        self._resumed_rank_state: dict[str, Any] | None = None
        self._epoch_generator_state = train_loader.generator.get_state()

    # --- the loop ---------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        started = time.perf_counter()
        progress = tqdm(
            total=self.total_steps,
            initial=self.state.step,
            desc="train",
            disable=not (self.env.is_main and self.cfg.progress_bar and sys.stderr.isatty()),
        )
        window = self.window
        window.resume()
        final_save = self.checkpointer.cfg.final
        stop_signal = None
        while not self.finished() and stop_signal is None:
            for micro_batches in micro_batch_groups(self._epoch_batches(), self.cfg.grad_accum):
                lr = self.optimizer.param_groups[0]["lr"]
                loss, verdict = self.train_step(micro_batches)
                self.state.step += 1
                if loss is not None:  # None: a skipped step, its loss is not worth averaging
                    window.add(loss)
                progress.update()
                if self.state.step % self.cfg.log_every == 0 or self.finished():
                    self.log_train(window, lr)
                if self.cfg.eval_every and self.state.step % self.cfg.eval_every == 0:
                    window.pause()
                    self.log_eval()
                    window.resume()
                ending = verdict.stop_signal or self.finished()
                if self.checkpointer.due(self.state.step) and not (ending and final_save):
                    self.save_checkpoint()
                if ending:
                    stop_signal = verdict.stop_signal
                    break
            else:
                self.state.epoch += 1
        progress.close()
        self.agreement.collect()  # the last step's exchange: nothing may stay in flight
        self.state.train_seconds += window.pause()
        if stop_signal:
            path = self.save_checkpoint() if final_save else None
            raise StopRun(stop_signal, self.state.step, path and str(path))
        if final_save:
            self.save_checkpoint()
        self.check_replicas_agree()
        final = self.evaluate()
        return self.summary(final, wall_s=time.perf_counter() - started)

    def _epoch_batches(self) -> Iterator:
        """This epoch's loader iterator, starting where the (resumed) run stands in it."""
        done_in_epoch = self.state.step - self.state.epoch * self.steps_per_epoch
        self.train_sampler.set_epoch(self.state.epoch, skip=done_in_epoch * self.cfg.grad_accum
                                     * self.train_loader.batch_size)  # fmt: skip
        generator = self.train_loader.generator
        resumed = self._resumed_rank_state
        if resumed is not None:
            generator.set_state(resumed["loader_generator"])
        self._epoch_generator_state = generator.get_state()  # iter() below draws from it
        batches = iter(self.train_loader)
        if resumed is not None:
            # After iter(): building the iterator must not consume the restored streams.
            restore_rng(resumed["rng"])
            self._resumed_rank_state = None
        return batches

    def to_device(self, inputs: torch.Tensor) -> torch.Tensor:
        """Images go channels-last when the model is (trainer.channels_last)."""
        if self.cfg.channels_last and inputs.dim() == 4:
            return inputs.to(self.device, non_blocking=True, memory_format=torch.channels_last)
        return inputs.to(self.device, non_blocking=True)

    def train_step(self, micro_batches: list) -> tuple[torch.Tensor | None, Verdict]:
        """One optimizer step over grad_accum micro-batches. Returns the mean loss (on device;
        None when the update was skipped) and what every rank learned at this step."""
        if not self.module.training:  # only after an evaluation: train() walks every module
            self.model.train()
        loss_sum = torch.zeros((), device=self.device)
        last = len(micro_batches) - 1
        for index, (inputs, targets) in enumerate(micro_batches):
            inputs = self.to_device(inputs)
            targets = targets.to(self.device, non_blocking=True)
            # Only the last micro-batch synchronises gradients; the others accumulate locally.
            sync = index == last or not self.env.distributed
            with contextlib.nullcontext() if sync else self.model.no_sync():
                with self.precision.forward_context():
                    loss = F.cross_entropy(self.model(inputs), targets)
                self.precision.backward(loss / len(micro_batches))
            loss_sum += loss.detach().float()
        previous = self.agreement.exchange(torch.isfinite(loss_sum))
        if self._grads_finite():
            verdict = previous
            if verdict.nonfinite_loss_ranks:  # a loss went bad alone one step ago
                self._nonfinite(verdict.nonfinite_loss_ranks, step=self.state.step, kept=True)
            self.precision.step(self.optimizer, self.module.parameters(), self.cfg.clip_grad_norm)
            if self.ema is not None:
                self.ema.update_parameters(self.module)
            mean_loss: torch.Tensor | None = loss_sum / len(micro_batches)
        else:
            # Every rank is here (same gradients): wait for this step's exchange to name the
            # ranks whose loss went bad, then stop or skip the update.
            current = self.agreement.collect()
            verdict = Verdict(previous.stop_signal or current.stop_signal,
                              current.nonfinite_loss_ranks)  # fmt: skip
            self._nonfinite(current.nonfinite_loss_ranks, step=self.state.step + 1, kept=False)
            mean_loss = None
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.state.samples_seen += self.global_batch_size
        return mean_loss, verdict

    def _grads_finite(self) -> bool:
        """After DDP's synchronisation the gradients are identical on every rank, so this
        rank's answer is every rank's, at the same step, with no exchange."""
        if self.precision.skips_nonfinite_grads:  # amp's GradScaler skips inf gradients itself
            return True
        grads = [p.grad for p in self.params if p.grad is not None]
        return not grads or bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all())

    def _nonfinite(self, loss_ranks: list[int], step: int, kept: bool) -> None:
        """Stop (trainer.on_nonfinite=stop) or skip; `kept`: only the loss of `step` went bad,
        its gradients were finite and its update was applied."""
        if loss_ranks:
            what = f"loss on rank(s) {', '.join(map(str, loss_ranks))}"
        else:
            what = "gradients (identical on every rank)"
        where = f"non-finite {what} at step {step} (epoch {self.state.epoch})"
        if kept:
            where += " with finite gradients (that update was applied)"
        if self.cfg.on_nonfinite == "stop":
            last = self.checkpointer.last_path
            saved = f"the last good checkpoint is {last}" if last else "no checkpoint was saved"
            raise NonFiniteLoss(
                f"{where}: stopped without saving; {saved}. Lower optimizer.lr, set "
                "trainer.clip_grad_norm, or set trainer.on_nonfinite=skip to skip such steps"
            )
        if not kept:
            self.state.nonfinite_skipped += 1
        log.warning("%s: %s (trainer.on_nonfinite=skip)", where,
                    "continuing" if kept else "update skipped")  # fmt: skip

    def epochs_done(self) -> float:
        return round(self.state.step / max(self.steps_per_epoch, 1), 4)

    def finished(self) -> bool:
        return self.state.step >= self.total_steps

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation loss and accuracy, summed over every rank's shard (no padding)."""
        model = self.ema.module if self.ema is not None else self.module
        model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss, correct, count
        for inputs, targets in self.val_loader:
            inputs = self.to_device(inputs)
            targets = targets.to(self.device, non_blocking=True)
            with self.precision.forward_context():
                logits = model(inputs).float()
            totals[0] += F.cross_entropy(logits, targets, reduction="sum").double()
            totals[1] += (logits.argmax(dim=1) == targets).sum()
            totals[2] += targets.numel()
        loss_sum, correct, count = all_reduce_sum(totals).tolist()
        return {"val/loss": loss_sum / max(count, 1), "val/accuracy": correct / max(count, 1)}

    # --- sinks ------------------------------------------------------------------------------
    def log_train(self, window: _Window, lr: float) -> None:
        # The one host sync of a logging step: reduce the window's loss over all ranks.
        mean_loss = all_reduce_sum(window.loss_sum.clone()).item() / max(
            window.steps * self.env.world_size, 1
        )
        steps, seconds = window.steps, window.close()
        self.state.train_seconds += seconds
        event = {
            "step": self.state.step,
            "epoch": self.epochs_done(),
            "train/loss": mean_loss,
            "lr": lr,
            "samples_per_s": steps * self.global_batch_size / max(seconds, 1e-9),
            "train/nonfinite_skipped": self.state.nonfinite_skipped,
            **self.precision.metrics(),
            **self.comm.metrics(),
        }
        self.sink.log(event)

    def log_eval(self) -> dict[str, float]:
        metrics = self.evaluate()
        self.sink.log({"step": self.state.step, "epoch": self.epochs_done(), **metrics})
        return metrics

    # --- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        return self.checkpointer.save(self.state.step, self._shared_state, self._rank_state())

    def _shared_state(self) -> dict[str, Any]:
        """What is identical on every rank (rank 0's copy is saved)."""
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "precision": self.precision.state_dict(),
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "trainer": dataclasses.asdict(self.state),
            "steps_per_epoch": self.steps_per_epoch,
        }

    def _rank_state(self) -> dict[str, Any]:
        """What differs per rank: RNG streams, the loader's generator, comm-hook memory, and
        the loss of the current logging window."""
        return {
            "rng": rng_state(),
            "loader_generator": self._epoch_generator_state,
            "comm": self.comm.state_dict(),
            "window": {"loss_sum": self.window.loss_sum.cpu(), "steps": self.window.steps},
        }

    def load_checkpoint(self, path: Path, payload: dict[str, Any]) -> None:
        """Restore everything; the RNG streams are applied when fit() rebuilds the iterator."""
        check_model_keys(path, payload["model"], self.module)
        self.module.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.scheduler.load_state_dict(payload["scheduler"])
        self.precision.load_state_dict(payload["precision"])
        if self.ema is not None and payload["ema"] is not None:
            self.ema.load_state_dict(payload["ema"])
        self.state = TrainState(**payload["trainer"])
        mine = payload["ranks"][self.env.rank]
        self.comm.load_state_dict(mine["comm"])
        self.window.loss_sum.copy_(mine["window"]["loss_sum"])
        self.window.steps = mine["window"]["steps"]
        self._resumed_rank_state = mine

    def check_replicas_agree(self) -> None:
        """DDP keeps every rank's weights bit-identical. If they differ, the ranks did not
        train one model: different configs (an lr per rank) or different code. Costs one tiny
        all-gather per run."""
        if not self.env.distributed:
            return
        checksum = torch.stack([p.detach().double().sum() for p in self.module.parameters()])
        checksums = [torch.empty_like(checksum) for _ in range(self.env.world_size)]
        dist.all_gather(checksums, checksum)
        # Close, not bit-equal: ranks on different GPU models may round differently. NaN
        # weights (a run that trained through non-finite steps) compare equal to NaN.
        differing = [rank for rank, other in enumerate(checksums) if not torch.allclose(
            other, checksums[0], rtol=1e-5, atol=1e-8, equal_nan=True)]  # fmt: skip
        if differing:
            raise ReplicasDiverged(
                f"after step {self.state.step} the weights of rank(s) {differing} differ from "
                "rank 0's: the ranks did not run the same config or code (one resolved config "
                "for every rank is what the launchers guarantee; check custom launch scripts)"
            )

    def summary(self, final: dict[str, float], wall_s: float) -> dict[str, Any]:
        summary = {
            **final,
            "steps": self.state.step,
            "epochs": self.epochs_done(),
            "world_size": self.env.world_size,
            "global_batch_size": self.global_batch_size,
            "samples_per_s": self.state.samples_seen / max(self.state.train_seconds, 1e-9),
            "wall_s": wall_s,
            **self.precision.metrics(),
            **self.comm.metrics(),
        }
        self.sink.log({"step": self.state.step, "epoch": self.epochs_done(), **final})
        self.sink.summary(summary)
        return summary


class ReplicasDiverged(RuntimeError):
    """The ranks' weights differ at the end of training."""


class _Window:
    """Loss and training time since the last log event; the loss stays on device."""

    def __init__(self, device: torch.device) -> None:
        self.loss_sum = torch.zeros((), device=device)
        self.steps = 0
        self.seconds = 0.0
        self.started = time.perf_counter()

    def add(self, loss: torch.Tensor) -> None:
        self.loss_sum += loss
        self.steps += 1

    def pause(self) -> float:
        """Stop the clock (evaluation time is not training time); returns the seconds."""
        self.seconds += time.perf_counter() - self.started
        self.started = time.perf_counter()
        return self.seconds

    def resume(self) -> None:
        self.started = time.perf_counter()

    def close(self) -> float:
        """Training seconds in this window; starts the next one."""
        self.pause()
        seconds = self.seconds
        self.loss_sum.zero_()
        self.steps, self.seconds = 0, 0.0
        self.resume()
        return seconds


def planned_steps(trainer_cfg: Any, steps_per_epoch: int) -> int:
    """Optimizer steps until max_steps or max_epochs, whichever comes first (validate()
    guarantees at least one is set)."""
    limits = []
    if trainer_cfg.max_steps is not None:
        limits.append(trainer_cfg.max_steps)
    if trainer_cfg.max_epochs is not None:
        limits.append(trainer_cfg.max_epochs * steps_per_epoch)
    return min(limits)
