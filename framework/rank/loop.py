"""The one training loop: fit() -> train_step() / evaluation -> checkpoints and metric sinks.

The Runner is built from the bundles build.py makes: the shared `Parts` (the trainer settings,
task, loaders and model), `TrainingParts` (the optimization, what evaluations decide
(model_selection.py), the stop-signal exchange (stopping.py), the meter) and `Outputs` (where
results go). Its side paths each have one owner: the checkpoint holds `run_states` (state.py)
and the Checkpointer decides when and how it is saved; non-finite values are the
NonFiniteGuard's (nonfinite.py).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from tqdm import tqdm

from framework.components.data import to_device
from framework.components.ledger import Ledger, every_rank, held
from framework.components.loggers import MetricSink
from framework.components.tasks.base import Count, TaskLoss
from framework.core import startup_clock
from framework.core.distributed import all_reduce_sum
from framework.core.exits import ReplicasDiverged, Stopped
from framework.core.launch_context import DistEnv
from framework.rank.build import Parts, TrainingParts
from framework.rank.evaluation import evaluate
from framework.rank.nonfinite import NonFiniteGuard
from framework.rank.state import (
    DataIdentity,
    LoaderPosition,
    Optimization,
    RNGStreams,
    TrainState,
    run_states,
)
from framework.storage.checkpoint import Checkpointer, check_model_keys

log = logging.getLogger("framework")


@dataclass(frozen=True)
class Outputs:
    """Where a run's results go."""

    sink: MetricSink  # metrics, summary and files (a null sink on ranks > 0)
    checkpointer: Checkpointer  # checkpoints/: periodic, final and best
    profile_dir: Path | None = None  # where trainer.profile_steps' trace goes (rank 0)


def micro_batch_groups(loader: Iterable, size: int) -> Iterator[list]:
    """Consecutive groups of `size` micro-batches; a short tail group is dropped."""
    iterator = iter(loader)
    while len(group := list(itertools.islice(iterator, size))) == size:
        yield group


class Runner:
    """fit() trains to the planned step, saving, logging and evaluating on the way.

    What a checkpoint holds is the registry `states` (state.py): a new stateful component is
    one entry with state_dict() / load_state_dict()."""

    def __init__(
        self, parts: Parts, training: TrainingParts, outputs: Outputs, env: DistEnv
    ) -> None:
        trainer, optimization = parts.trainer, training.optimization
        self.env, self.device, self.trainer, self.task = env, parts.device, trainer, parts.task
        self.model, self.loaders = parts.model, parts.loaders
        self.selection, self.signals = training.selection, training.signals
        self.meter = training.meter
        self.sink, self.checkpointer = outputs.sink, outputs.checkpointer
        self.optimizer, self.scheduler = optimization.optimizer, optimization.scheduler
        self.precision, self.comm = optimization.precision, optimization.comm
        self.strategy = self.model.strategy
        self.params = list(self.model.module.parameters())  # walked every step: listed once
        self.global_batch_size = parts.global_batch_size
        self.steps_per_epoch = len(self.loaders.train) // trainer.grad_accum
        self.total_steps = parts.total_steps
        self.profiler = _StepProfiler(
            trainer.profile_steps, outputs.profile_dir if env.is_main else None
        )
        self.nonfinite = NonFiniteGuard(
            trainer.on_nonfinite,
            env,
            self.device,
            skips_itself=self.precision.skips_nonfinite_grads,
            agree=self.strategy.agree,
            epoch_of=self.epoch_of,
        )
        # trainer.on_nonfinite=skip drops a step's update on the device where the optimizer
        # takes GradScaler's found_inf (torch's fused SGD/Adam/AdamW); others need a host read.
        self.skip_on_device = getattr(self.optimizer, "_step_supports_amp_scaling", False)
        self._last_evaluation: tuple[int, dict[str, float]] | None = None
        self.ledgers: list[Ledger] = []  # measured after the first step
        self._track_state(optimization)

    def _track_state(self, optimization: Optimization) -> None:
        """What advances as training goes, and the registry of what a checkpoint saves."""
        self.state = TrainState()
        self.window = _Window(self.device, extras=self.task.train_sums)
        self.rng = RNGStreams()
        self.position = LoaderPosition(self.loaders.train.generator)
        self.states = run_states(
            self.model,
            optimization,
            self.state,
            self.selection,
            per_rank={"rng": self.rng, "loader_generator": self.position, "window": self.window},
            steps_per_epoch=self.steps_per_epoch,
            data=DataIdentity(self.loaders.train.dataset),
        )

    # --- the loop ---------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to the planned step (or a stop), save, evaluate, test; returns the summary."""
        started = time.perf_counter()
        stop_signal = self._train_loop()
        self.signals.collect()  # the last step's exchange: nothing may stay in flight
        self.look_for_nonfinite()
        self.state.train_seconds += self.window.pause()
        path = self.save_checkpoint(final=True)
        if stop_signal:
            raise Stopped(stop_signal, self.state.step, path and str(path))
        self.checkpointer.finish_pending()  # a background save's failure ends the run here
        self.check_replicas_agree()
        final = self.final_evaluation()
        return self.summary({**final, **self.test()}, wall_s=time.perf_counter() - started)

    def _train_loop(self) -> str | None:
        """Steps until the plan is done, early stopping ended the run, or every rank agreed on
        a stop signal (returned)."""
        progress = self._progress_bar()
        self.window.resume()
        first_step = self.state.step + 1
        batches = self._step_batches()
        agreed_signal = None
        while not self.done():
            micro_batches = next(batches)
            lr = self.optimizer.param_groups[0]["lr"]  # before train_step moves the schedule
            self.profiler.before(self.state.step + 1)
            step_totals, agreed_signal = self.train_step(micro_batches)
            self.profiler.after(self.state.step)
            if self.state.step == first_step:
                self._log_startup()
            self.window.add(step_totals)
            progress.update()
            if self.logs_at(self.state.step):
                self.log_train(lr)
            if self.evaluates_at(self.state.step):
                self.periodic_evaluation()
            self.save_checkpoint(ending=bool(agreed_signal) or self.done())
            if agreed_signal:
                break
        progress.close()
        if self.selection.pruned:  # every rank says where it stopped: one step, agreed
            log.warning(
                "%s; rank %d stops at step %d",
                self.selection.pruned,
                self.env.rank,
                self.state.step,
            )
        elif self.selection.stopped_early and self.env.is_main:
            log.warning("%s; stopping at step %d", self.selection.stopped_early, self.state.step)
        return agreed_signal

    def _step_batches(self) -> Iterator[list]:
        """Each step's grad_accum micro-batches, epoch after epoch, from where the (resumed)
        run stands."""
        while True:
            yield from micro_batch_groups(self._epoch_batches(), self.trainer.grad_accum)
            self.state.epoch += 1
            self.state.samples_in_epoch = 0

    def _epoch_batches(self) -> Iterator:
        """This epoch's loader iterator, starting where the (resumed) run stands in it."""
        # From the global number of samples consumed: the same on any number of ranks.
        self.loaders.sampler.set_epoch(self.state.epoch, start=self.state.samples_in_epoch)
        self.position.start_epoch()  # iter() below draws from the loader's generator
        batches = iter(self.loaders.train)
        # After iter(): building the iterator must not consume the restored streams.
        self.rng.apply_restored()
        return batches

    def _progress_bar(self) -> tqdm:
        return tqdm(
            total=self.total_steps,
            initial=self.state.step,
            desc="train",
            disable=not (self.env.is_main and self.trainer.progress_bar and sys.stderr.isatty()),
        )

    def _log_startup(self) -> None:
        startup_clock.mark("first step")
        line = startup_clock.summary()
        if line and self.env.is_main:
            log.info("start-up: %s", line)

    def to_device(self, batch: Any) -> Any:
        return to_device(batch, self.device, self.trainer.channels_last)

    def train_step(self, micro_batches: list) -> tuple[torch.Tensor, str | None]:
        """One optimizer step over grad_accum micro-batches. Returns this rank's [loss sum, item
        count, train sums...] for the log window (on the device; zeros when the update was
        dropped) and the stop signal every rank agreed on a step earlier. Reads nothing that the
        device computed: the step never waits for it."""
        model = self.model.train  # DDP-wrapped, compiled: what forward and backward run on
        if not self.model.module.training:  # only after an evaluation: train() walks every module
            model.train()
        step = self.state.step + 1
        counts = [self.task.count(batch) for batch in micro_batches]
        scale = self._per_item(counts)
        totals = self.window.zeros()
        for index, batch in enumerate(micro_batches):
            # Only the last micro-batch synchronises gradients; the others accumulate locally.
            with self._syncing(model, last=index == len(micro_batches) - 1):
                with self.precision.forward_context():
                    loss = self.task.loss(model, self.to_device(batch))
                self.precision.backward(loss.total * scale)
            totals += self.window.row(loss)
        totals[1] += sum(counts)
        agreed_signal = self.signals.exchange(step, logging=self.logs_at(step))
        applied = self.update(step, totals)
        self.scheduler.step()
        self.state.advance(self.global_batch_size)
        # A dropped update's loss is not averaged into train/loss.
        return (totals if applied is None else torch.where(applied, totals, 0.0)), agreed_signal

    def update(self, step: int, totals: torch.Tensor) -> torch.Tensor | None:
        """nanoGPT's order: unscale (amp), clip, step the optimizer (and the EMA) unless the
        non-finite guard drops the update, zero the gradients. Returns whether the update was
        applied (a device flag; None: trainer.on_nonfinite=stop, which never drops one)."""
        self.precision.unscale(self.optimizer)
        if self.trainer.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.trainer.clip_grad_norm)
        applied = self.nonfinite.step(
            step,
            totals,
            self.params,
            update=lambda found_inf: self.precision.step(self.optimizer, found_inf),
            skip_on_device=self.skip_on_device,
        )
        if self.model.ema is not None:
            self.model.ema.update(self.model.module, applied)
        if not self.ledgers:  # gradients and the optimizer's state all exist now
            self.record_ledgers()
        self.optimizer.zero_grad(set_to_none=True)
        return applied

    def record_ledgers(self) -> None:
        """Every rank's memory ledger (exact tensor bytes), logged by rank 0 once per run."""
        own = held(self.model.module, self.optimizer)
        self.ledgers = every_rank(own, self.env.rank, self.env.world_size, self.device)
        if self.env.is_main:
            for rank, ledger in enumerate(self.ledgers):
                log.info("memory ledger, rank %d (exact tensor bytes): %s", rank, ledger.line())

    def _syncing(self, model: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """Gradient synchronisation on the last micro-batch of a step; local accumulation
        before it."""
        if last or not self.env.distributed:
            return contextlib.nullcontext()
        return self.strategy.no_sync(model, self.model.module)

    def _per_item(self, counts: list[Count]) -> float | torch.Tensor:
        """What each micro-batch's summed loss is multiplied by: world_size / the items of the
        whole step (every micro-batch of every rank). DDP averages gradients over the ranks, so
        the step's gradient is that of the mean loss over all of its items. A count that
        follows from shapes (an int) is the same on every rank: no collective."""
        if all(isinstance(count, int) for count in counts):
            return 1.0 / max(sum(counts), 1)
        # Counted on the host's copy of the batch; pinned, the copy waits for no device work.
        local = sum(torch.as_tensor(count, dtype=torch.float64) for count in counts)
        if self.device.type == "cuda":
            local = local.pin_memory()
        total = all_reduce_sum(local.to(self.device, non_blocking=True))  # one small collective
        return self.env.world_size / total.clamp_min(1.0)

    def look_for_nonfinite(self, rider: torch.Tensor | None = None) -> list[float]:
        """Collective, before anything is logged or saved (nonfinite.py). `rider` is summed over
        the ranks in the same all-reduce and returned."""
        skipped_before = self.nonfinite.skipped
        summed = self.nonfinite.look(self.checkpointer.last_path, rider)
        self.state.nonfinite_skipped += self.nonfinite.skipped - skipped_before
        return summed

    # --- when ---------------------------------------------------------------------------------
    def epoch_of(self, step: int) -> int:
        return (step - 1) // max(self.steps_per_epoch, 1)

    def epochs_done(self) -> float:
        """Epochs of samples seen, whatever the world size of each step: the epochs completed
        and the part of this one (a resume on other ranks changes the steps per epoch)."""
        per_epoch = max(self.steps_per_epoch * self.global_batch_size, 1)
        return round(self.state.epoch + self.state.samples_in_epoch / per_epoch, 4)

    def logs_at(self, step: int) -> bool:
        return step % self.trainer.log_every == 0 or step >= self.total_steps

    def evaluates_at(self, step: int) -> bool:
        """Every trainer.eval_every steps; the last step's evaluation is the final one, after
        the final save."""
        every = self.trainer.eval_every
        return bool(every) and step % every == 0 and not self.finished()

    def finished(self) -> bool:
        return self.state.step >= self.total_steps

    def done(self) -> bool:
        return self.finished() or self.selection.stopped_early is not None

    # --- evaluation -------------------------------------------------------------------------
    def evaluate(self, loader: DataLoader, split: str) -> dict[str, float]:
        """The task's metrics over a split (`split/<metric>`), the same on any world size; a
        validation sees trainer.eval_batches batches per rank at most."""
        return evaluate(
            self.task,
            self.model.evaluated,
            loader,
            self.precision,
            self.to_device,
            split,
            lockstep=self.strategy.shards,
            max_batches=self.trainer.eval_batches if split == "val" else None,
        )

    def periodic_evaluation(self) -> None:
        self.window.pause()  # evaluation time is not training time
        self.after_evaluation(self.log_eval(), periodic=True)
        self.window.resume()

    def final_evaluation(self) -> dict[str, float]:
        """The end's evaluation; the last periodic one if it was at this very step (early
        stopping right after it), which is then not run or logged again."""
        if self._last_evaluation is not None and self._last_evaluation[0] == self.state.step:
            return self._last_evaluation[1]
        metrics = self.evaluate(self.loaders.val, "val")
        self.log_metrics(metrics)
        self.after_evaluation(metrics, periodic=False)
        return metrics

    def after_evaluation(self, metrics: dict[str, float], periodic: bool) -> None:
        """A best checkpoint (checkpoint.best) and early stopping: model_selection.py decides."""
        self._last_evaluation = (self.state.step, metrics)
        self.selection.after_evaluation(
            self.state.step, metrics, periodic, save_best=self.save_best_checkpoint
        )

    def test(self) -> dict[str, float]:
        """test/* metrics, when the data has a test split: with the best checkpoint's weights
        (checkpoint.best), else with the final ones."""
        if self.loaders.test is None:
            return {}
        source = self.selection.test_weights(self.checkpointer, self.env.is_main, self.model)
        metrics = self.evaluate(self.loaders.test, "test")
        self.log_metrics({**metrics, "test/weights": source})
        return {**metrics, "test/weights": source}

    # --- sinks ------------------------------------------------------------------------------
    def log_train(self, lr: float) -> None:
        # The window's sums and every rank's peak memory (each rank in its own slot) ride on
        # the look's all-reduce: the logging step's one collective and one read of the device.
        window = self.window
        memory = self.meter.memory_rider()
        summed = self.look_for_nonfinite(rider=torch.cat([window.totals, memory]))
        (loss, count, *sums), memory_mib = summed[: -len(memory)], summed[-len(memory) :]

        def per_item(total: float) -> float:  # NaN when every update of the window was dropped
            return total / count if count else math.nan

        train_sums = {
            f"train/{name}": per_item(value)
            for name, value in zip(self.task.train_sums, sums, strict=True)
        }
        steps, seconds = window.steps, window.close()
        self.state.train_seconds += seconds
        self.log_metrics(
            {
                "train/loss": per_item(loss),
                **train_sums,
                "lr": lr,
                "samples_per_s": steps * self.global_batch_size / max(seconds, 1e-9),
                **self.meter.metrics(steps, seconds, memory_mib),
                "train/nonfinite_skipped": self.state.nonfinite_skipped,
                **self.precision.metrics(),
                **self.comm.metrics(),
            }
        )

    def log_eval(self) -> dict[str, float]:
        self.look_for_nonfinite()
        metrics = self.evaluate(self.loaders.val, "val")
        self.log_metrics(metrics)
        return metrics

    def log_metrics(self, metrics: dict[str, Any]) -> None:
        self.sink.log({"step": self.state.step, "epoch": self.epochs_done(), **metrics})

    # --- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(
        self, *, ending: bool = False, final: bool = False, best: tuple[float, bool] | None = None
    ) -> Path | None:
        """Collective: the checkpoint of this step where the Checkpointer says one is due (or
        `best`: (score, maximize), among the best), after a look for non-finite values."""
        return self.checkpointer.save(
            self.state.step,
            self.states,
            ending=ending,
            final=final,
            best=best,
            before=self.look_for_nonfinite,
        )

    def save_best_checkpoint(self, score: float) -> None:
        self.save_checkpoint(best=(score, self.selection.maximize))

    def load_checkpoint(self, path: Path, payload: dict[str, Any]) -> None:
        """Restore every registered state; the RNG streams and the loader's position apply
        when fit() builds the epoch's iterator."""
        check_model_keys(path, payload["model"], self.model.module)
        saved_ranks = payload["ranks"]
        if len(saved_ranks) == self.env.world_size:
            self.states.load_state_dict(payload, saved_ranks[self.env.rank])
        else:  # per-rank states have no counterpart on another number of ranks
            self.states.load_state_dict(payload, None)
            if self.env.is_main:  # the unlogged steps' sums: one all-reduce adds them anyway
                self.window.load_state_dict(_merged_windows(saved_ranks))
        if "samples_in_epoch" not in payload["trainer"]:  # a checkpoint from before the field
            done = self.state.step - self.state.epoch * payload["steps_per_epoch"]
            self.state.samples_in_epoch = done * self.global_batch_size

    def check_replicas_agree(self) -> None:
        """DDP keeps every rank's weights bit-identical. If they differ, the ranks did not
        train one model: different configs (an lr per rank) or different code. Costs one tiny
        all-gather per run. Under strategy=fsdp each rank holds other shards: nothing to
        compare."""
        if not self.env.distributed or self.strategy.shards:
            return
        checksum = torch.stack([p.detach().double().sum() for p in self.model.module.parameters()])
        checksums = [torch.empty_like(checksum) for _ in range(self.env.world_size)]
        dist.all_gather(checksums, checksum)
        # Close, not bit-equal: ranks on different GPU models may round differently. NaN
        # weights (a run that trained through non-finite steps) compare equal to NaN.
        differing = [
            rank
            for rank, other in enumerate(checksums)
            if not torch.allclose(other, checksums[0], rtol=1e-5, atol=1e-8, equal_nan=True)
        ]
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
            **self.meter.summary(self.state.step, self.state.train_seconds),
            **self.precision.metrics(),
            **self.comm.metrics(),
        }
        if self.ledgers:
            summary["memory/ledger"] = [ledger.as_dict() for ledger in self.ledgers]
        if self.selection.stopped_early:
            summary["stopped_early"] = self.selection.stopped_early
        if self.selection.pruned:
            summary["pruned"] = True
        return summary


def _merged_windows(saved_ranks: list[dict[str, Any]]) -> dict[str, Any]:
    windows = [rank["window"] for rank in saved_ranks]
    totals = torch.stack([window["totals"] for window in windows]).sum(0)
    return {"totals": totals, "steps": windows[0]["steps"]}


class _Window:
    """Since the last log event: [loss sum, item count, the task's train sums...] (on device)
    and the training time."""

    def __init__(self, device: torch.device, extras: tuple[str, ...] = ()) -> None:
        self.extras = extras
        self.totals = torch.zeros(2 + len(extras), dtype=torch.float64, device=device)
        self._zero = torch.zeros((), dtype=torch.float64, device=device)
        self.steps = 0
        self.seconds = 0.0
        self.started = time.perf_counter()

    def zeros(self) -> torch.Tensor:
        """A step's totals, before its first micro-batch."""
        return torch.zeros_like(self.totals)

    def row(self, loss: TaskLoss) -> torch.Tensor:
        """A micro-batch's [loss sum, 0 (the count comes from the batches), train sums...]."""
        parts = [loss.total, self._zero, *(loss.sums[name] for name in self.extras)]
        return torch.stack([part.detach().to(torch.float64) for part in parts])

    def add(self, step_totals: torch.Tensor) -> None:
        self.totals += step_totals
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
        self.totals.zero_()
        self.steps, self.seconds = 0, 0.0
        self.resume()
        return seconds

    def state_dict(self) -> dict[str, Any]:
        return {"totals": self.totals.cpu(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.totals.copy_(state["totals"])
        self.steps = state["steps"]


class _StepProfiler:
    """trainer.profile_steps = [first, last]: a torch.profiler trace of those optimizer steps,
    written by rank 0 into <run dir>/profile/ (TensorBoard's profiler plugin and Perfetto read
    it). Off: two integer comparisons per step."""

    def __init__(self, steps: list[int], directory: Path | None) -> None:
        self.first, self.last = (steps[0], steps[-1]) if steps and directory else (0, 0)
        self.directory, self.profile = directory, None

    def before(self, step: int) -> None:
        if step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profile = torch.profiler.profile(activities=activities)
            self.profile.__enter__()

    def after(self, step: int) -> None:
        if step == self.last and self.profile is not None:
            self.profile.__exit__(None, None, None)
            torch.profiler.tensorboard_trace_handler(str(self.directory))(self.profile)
            log.info("profile of steps %d-%d: %s", self.first, self.last, self.directory)
            self.profile = None
