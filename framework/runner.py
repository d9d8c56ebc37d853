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
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.swa_utils import AveragedModel
from tqdm import tqdm

from framework.checkpoint import Checkpointer, check_model_keys, restore_rng, rng_state
from framework.comm import Comm
from framework.context import DistEnv
from framework.data import Loaders
from framework.distributed import all_reduce_sum
from framework.outcomes import ReplicasDiverged, Stopped
from framework.precision import Precision
from framework.sinks import MetricSink
from framework.stopping import NonFinitePolicy, StepAgreement, StopRequests, Verdict

log = logging.getLogger("framework")


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainState:
    """Everything that advances as training goes; small and explicit."""

    step: int = 0
    epoch: int = 0
    samples_seen: int = 0
    train_seconds: float = 0.0
    nonfinite_skipped: int = 0

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


@dataclass(frozen=True)
class Model:
    """The model in its three roles."""

    train: nn.Module  # what forward/backward run on (DDP-wrapped, compiled)
    module: nn.Module  # the bare model under it: its state_dict is what is saved
    ema: AveragedModel | None = None  # evaluated instead of `module` when set


@dataclass(frozen=True)
class Optimization:
    optimizer: Optimizer
    scheduler: LRScheduler
    precision: Precision
    comm: Comm


def micro_batch_groups(loader: Iterable, size: int) -> Iterator[list]:
    """Consecutive groups of `size` micro-batches; a short tail group is dropped."""
    iterator = iter(loader)
    while len(group := list(itertools.islice(iterator, size))) == size:
        yield group


class Runner:
    """fit() trains to the planned step, saving, logging and evaluating on the way.

    What a checkpoint holds is the registry below: `shared` (identical on every rank; rank 0's
    copy is saved) and `per_rank` (RNG streams, the loader's position, comm-hook memory). A new
    stateful component is one entry with state_dict() / load_state_dict()."""

    def __init__(
        self,
        *,
        env: DistEnv,
        device: torch.device,
        trainer: SimpleNamespace,  # trainer.* as plain attributes (read every step)
        model: Model,
        loaders: Loaders,
        optimization: Optimization,
        sink: MetricSink,
        checkpointer: Checkpointer,
        stop_requests: StopRequests,
    ) -> None:
        self.env, self.device, self.cfg = env, device, trainer
        self.model, self.module, self.ema = model.train, model.module, model.ema
        self.params = list(model.module.parameters())  # walked every step: listed once
        self.optimizer, self.scheduler = optimization.optimizer, optimization.scheduler
        self.precision, self.comm = optimization.precision, optimization.comm
        self.train_loader, self.train_sampler = loaders.train, loaders.sampler
        self.val_loader = loaders.val
        self.sink, self.checkpointer = sink, checkpointer
        self.global_batch_size = loaders.train.batch_size * env.world_size * trainer.grad_accum
        self.steps_per_epoch = len(loaders.train) // trainer.grad_accum
        self.total_steps = planned_steps(trainer, self.steps_per_epoch)
        self.agreement = StepAgreement(env, device, stop_requests)
        self.nonfinite = NonFinitePolicy(trainer.on_nonfinite)
        self.state = TrainState()
        self.window = _Window(device)
        self.rng = _RNGStreams()
        self.position = _LoaderPosition(loaders.train.generator)
        self.shared: dict[str, Stateful | None] = {
            "model": self.module, "optimizer": self.optimizer, "scheduler": self.scheduler,
            "precision": self.precision, "ema": self.ema, "trainer": self.state,
        }  # fmt: skip
        self.per_rank: dict[str, Stateful] = {
            "rng": self.rng, "loader_generator": self.position, "comm": self.comm,
            "window": self.window,
        }  # fmt: skip

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
            raise Stopped(stop_signal, self.state.step, path and str(path))
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
        self.position.start_epoch()  # iter() below draws from the loader's generator
        batches = iter(self.train_loader)
        # After iter(): building the iterator must not consume the restored streams.
        self.rng.apply_restored()
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
                self._on_nonfinite(verdict.nonfinite_loss_ranks, step=self.state.step, kept=True)
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
            self._on_nonfinite(current.nonfinite_loss_ranks, step=self.state.step + 1, kept=False)
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

    def _on_nonfinite(self, loss_ranks: list[int], step: int, kept: bool) -> None:
        self.state.nonfinite_skipped += self.nonfinite.handle(
            loss_ranks, step, self.state.epoch, kept, self.checkpointer.last_path
        )

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
        def shared() -> dict[str, Any]:  # built on rank 0 only
            states = {key: None if item is None else item.state_dict()
                      for key, item in self.shared.items()}  # fmt: skip
            return {**states, "steps_per_epoch": self.steps_per_epoch}

        per_rank = {key: item.state_dict() for key, item in self.per_rank.items()}
        return self.checkpointer.save(self.state.step, shared, per_rank)

    def load_checkpoint(self, path: Path, payload: dict[str, Any]) -> None:
        """Restore every registered state; the RNG streams and the loader's position apply
        when fit() builds the epoch's iterator."""
        check_model_keys(path, payload["model"], self.module)
        for key, item in self.shared.items():
            if item is not None and payload[key] is not None:
                item.load_state_dict(payload[key])
        mine = payload["ranks"][self.env.rank]
        for key, item in self.per_rank.items():
            item.load_state_dict(mine[key])

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

    def state_dict(self) -> dict[str, Any]:
        return {"loss_sum": self.loss_sum.cpu(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_sum.copy_(state["loss_sum"])
        self.steps = state["steps"]


class _RNGStreams:
    """This process's python, numpy, torch and CUDA streams. A restored state is applied only
    after the next epoch's iterator exists: building it draws from the global stream."""

    def __init__(self) -> None:
        self._restored: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._restored = state

    def apply_restored(self) -> None:
        if self._restored is not None:
            restore_rng(self._restored)
            self._restored = None


class _LoaderPosition:
    """The training loader's generator as the current epoch began (shuffling and workers' seeds
    come from it); the sampler's skip count comes from the step."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator
        self._restored: torch.Tensor | None = None
        self._epoch_start = generator.get_state()

    def start_epoch(self) -> None:
        if self._restored is not None:
            self.generator.set_state(self._restored)
            self._restored = None
        self._epoch_start = self.generator.get_state()

    def state_dict(self) -> torch.Tensor:  # type: ignore[override]
        return self._epoch_start

    def load_state_dict(self, state: torch.Tensor) -> None:  # type: ignore[override]
        self._restored = state


def planned_steps(trainer_cfg: Any, steps_per_epoch: int) -> int:
    """Optimizer steps until max_steps or max_epochs, whichever comes first (validate()
    guarantees at least one is set)."""
    limits = []
    if trainer_cfg.max_steps is not None:
        limits.append(trainer_cfg.max_steps)
    if trainer_cfg.max_epochs is not None:
        limits.append(trainer_cfg.max_epochs * steps_per_epoch)
    return min(limits)
