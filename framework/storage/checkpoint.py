"""Checkpoints: rank 0 writes one file per save, holding every rank's own state; all ranks read it.
With checkpoint.format=sharded (the default under strategy=fsdp) every rank writes its own
shards instead, into a step_<N>.dcp folder (sharded.py); the rest of this module treats both
alike.

<run dir>/checkpoints/
    step_00000120.pt    torch.save'd dict; `torch.load(path, weights_only=True)["model"]` is the
                        bare model's state_dict, so one process can load it for inference
    step_00000120.json  size and sha256 of the .pt, written once the .pt is durable
    last.pt             symlink to the newest (a step_*.pt file or a step_*.dcp folder)

A save is a temporary file, fsync, rename (and the same for the sidecar and the link), so a kill
at any moment leaves the previous checkpoint valid. Reads always use weights_only=True: a file
that holds pickled code is refused, never executed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pickle
import random
import shutil
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from framework.core.distributed import broadcast_object
from framework.core.exits import CheckpointError, SaveFailed, first_line
from framework.core.launch_context import DistEnv
from framework.storage import sharded
from framework.storage.files import atomic_write, fsync_dir, step_files
from framework.storage.sharded import ShardedState

log = logging.getLogger("framework")

FORMAT = "framework-checkpoint/1"
SHARDED_FORMAT = "framework-checkpoint/1+dcp"  # a step_*.dcp folder's sidecar


# --- what a checkpoint must match ----------------------------------------------------------
def settings_hash(settings: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(settings.items())).encode()).hexdigest()


# Which keys differ between a checkpoint's settings and this run's (saved, now).
Compare = Callable[[Mapping[str, str], Mapping[str, str]], list[str]]


def plainly_changed(saved: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    return sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))


def settings_differences(
    payload: Mapping, settings: Mapping[str, str], compare: Compare = plainly_changed
) -> list[str]:
    if payload["config_hash"] == settings_hash(settings):
        return []
    saved = payload["config"]
    changed = compare(saved, settings)
    return [
        f"{k}: {saved.get(k, '(absent)')} in the checkpoint, {settings.get(k, '(absent)')} now"
        for k in changed
    ]


def _shorten(items: list[str], limit: int = 6) -> str:
    more = f" (and {len(items) - limit} more)" if len(items) > limit else ""
    return "; ".join(items[:limit]) + more


def check_model_keys(
    path: Path, saved: Mapping[str, torch.Tensor] | ShardedState, model: torch.nn.Module
) -> None:
    """One error listing every mismatched key, instead of load_state_dict's first failure."""
    saved = (
        saved.shapes if isinstance(saved, ShardedState) else {k: v.shape for k, v in saved.items()}
    )
    expected = {key: value.shape for key, value in model.state_dict().items()}
    missing = sorted(expected.keys() - saved.keys())
    unexpected = sorted(saved.keys() - expected.keys())
    reshaped = sorted(
        f"{k} {tuple(saved[k])} vs {tuple(expected[k])}"
        for k in expected.keys() & saved.keys()
        if tuple(saved[k]) != tuple(expected[k])
    )
    problems = [
        f"{label}: {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}"
        for label, keys in (
            ("missing from the checkpoint", missing),
            ("not in this model", unexpected),
            ("shape (checkpoint vs model)", reshaped),
        )
        if keys
    ]
    if problems:
        raise CheckpointError(
            f"{path} holds a different model ({'; '.join(problems)}): resume with the model "
            "it was trained with, or set checkpoint.resume=never in a new hydra.run.dir"
        )


# --- RNG state, as plain values (weights_only loads refuse numpy objects) -----------------
def rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- files ---------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _save(directory: Path, step: int, payload: dict[str, Any], **sidecar: Any) -> Path:
    """step_<N>.pt and its .json (size, sha256 and `sidecar`), each written atomically."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:08d}.pt"
    atomic_write(path, lambda file: torch.save(payload, file))
    record = {
        "format": FORMAT,
        "step": step,
        "bytes": path.stat().st_size,
        "sha256": _sha256(path),
        **sidecar,
    }
    atomic_write(path.with_suffix(".json"), lambda f: f.write(json.dumps(record).encode()))
    return path


def _point(link: Path, target: str) -> None:
    """Atomically make `link` a symlink to `target` (relative to its folder)."""
    temporary = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    temporary.unlink(missing_ok=True)
    os.symlink(target, temporary)
    os.replace(temporary, link)


def _drop(path: Path) -> None:
    """A checkpoint of ours (a step_* file or folder in checkpoints/) and its sidecar."""
    path.with_suffix(".json").unlink(missing_ok=True)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _seal(partial: Path, step: int, **sidecar: Any) -> Path:
    """A complete sharded save (`partial`: DCP's files and state.pt) becomes step_<N>.dcp in
    one rename, then its sidecar lists every file's size and sha256."""
    final = partial.parent / f"step_{step:08d}{sharded.SUFFIX}"
    fsync_dir(partial)
    if final.exists():  # the same step saved again (a resumed run's final save)
        _drop(final)
    os.replace(partial, final)
    fsync_dir(final.parent)
    files = {
        item.name: {"bytes": item.stat().st_size, "sha256": _sha256(item)}
        for item in sorted(final.iterdir())
    }
    record = {"format": SHARDED_FORMAT, "step": step, "files": files, **sidecar}
    atomic_write(final.with_suffix(".json"), lambda f: f.write(json.dumps(record).encode()))
    return final


def write(directory: Path, step: int, payload: dict[str, Any], keep: int) -> Path:
    """Save atomically, point last.pt at it, then drop all but the newest `keep`."""
    path = _save(directory, step, payload)
    _publish(directory, path, keep)
    return path


def _publish(directory: Path, path: Path, keep: int) -> None:
    """last.pt -> `path`; all but the newest `keep` checkpoints dropped."""
    _point(directory / "last.pt", path.name)
    for _, old in step_files(directory)[keep:]:
        _drop(old)


def write_best(
    directory: Path, step: int, payload: dict[str, Any], score: float, maximize: bool, keep: int
) -> Path:
    """Save into <directory>/best/ with its score, keep the `keep` best, and point best.pt at
    the best of them; the log says where the new one ranks."""
    path = _save(directory / "best", step, payload, score=score)
    log.info("%s -> %s", best_line(step, score, _publish_best(directory, maximize, keep)), path)
    return path


def _publish_best(directory: Path, maximize: bool, keep: int) -> list[int]:
    """Keep the `keep` best, point best.pt at the best; the kept steps, best first."""
    ranked = sorted(
        step_files(directory / "best"),
        reverse=maximize,
        key=lambda found: _score(found[1], maximize),
    )
    for _, worse in ranked[keep:]:
        _drop(worse)
    _point(directory / "best.pt", f"best/{ranked[0][1].name}")
    return [found_step for found_step, _ in ranked[:keep]]


def best_line(step: int, score: float, kept: list[int]) -> str:
    """What a save among the best checkpoints is: the best so far, one of the K best, or (with
    a score that ties or trails all K) none of them."""
    if kept and kept[0] == step:
        return f"best checkpoint: step {step} ({score:.6g}), the best so far (best.pt)"
    if step in kept:
        return (
            f"checkpoint among the {len(kept)} best: step {step} ({score:.6g}) is number "
            f"{kept.index(step) + 1}; the best is still step {kept[0]} (best.pt)"
        )
    return f"checkpoint of step {step} ({score:.6g}) is not among the {len(kept)} best: dropped"


def _score(path: Path, maximize: bool) -> float:
    """A best checkpoint's score; one whose sidecar is damaged ranks last (it is dropped first)."""
    try:
        return float(json.loads(path.with_suffix(".json").read_text())["score"])
    except (OSError, KeyError, TypeError, ValueError):
        return -math.inf if maximize else math.inf


def read(path: Path) -> dict[str, Any]:
    """Load and verify one checkpoint (a file, or a sharded checkpoint's folder); CheckpointError
    names it and what is wrong. A sharded checkpoint's model, optimizer and EMA entries are
    ShardedStates: each rank loads its own slices from them."""
    path = Path(path)
    if path.is_dir():
        return _read_sharded(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    sidecar = path.resolve().with_suffix(".json")
    if sidecar.is_file():  # absent for a file copied on its own: torch.load still checks it
        expected = _read_sidecar(sidecar)
        _check_file(path, expected["bytes"], expected["sha256"], sidecar)
    return _load_ours(path, path)


def _check_file(path: Path, size: int, sha256: str, sidecar: Path) -> None:
    actual = path.stat().st_size if path.is_file() else -1
    if actual != size or _sha256(path) != sha256:
        raise CheckpointError(
            f"checkpoint {path} is corrupted or truncated ({max(actual, 0)} bytes, checksum "
            f"does not match {sidecar.name})"
        )


def _read_sharded(folder: Path) -> dict[str, Any]:
    """A step_*.dcp folder: every file checked against the sidecar (when there is one; DCP's
    index otherwise), state.pt loaded with weights_only, the shards left where they are."""
    resolved = folder.resolve()
    sidecar = resolved.with_suffix(".json")
    if sidecar.is_file():
        files = _read_sharded_sidecar(sidecar)
        for name, entry in files.items():
            _check_file(resolved / name, entry["bytes"], entry["sha256"], sidecar)
    if not (resolved / sharded.STATE_FILE).is_file():
        raise CheckpointError(f"{folder} is not a checkpoint written by this framework")
    sharded.check_index(resolved)
    payload = _load_ours(resolved / sharded.STATE_FILE, folder)
    for key, skeleton in payload.pop("sharded").items():
        payload[key] = None if skeleton is None else ShardedState(resolved, key, skeleton)
    return payload


def _read_sharded_sidecar(sidecar: Path) -> dict[str, Any]:
    try:
        record = json.loads(sidecar.read_text())
        files = record["files"]
        if not all(
            isinstance(e["bytes"], int) and isinstance(e["sha256"], str) for e in files.values()
        ):
            raise TypeError("entries without size or checksum")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"checkpoint sidecar {sidecar} is damaged ({error})") from None
    if any("/" in name or name in ("", ".", "..") for name in files):
        raise CheckpointError(f"checkpoint sidecar {sidecar} is damaged (a path in its list)")
    return files


def _load_ours(path: Path, checkpoint: Path) -> dict[str, Any]:
    """The payload at `path`, refused unless this framework wrote it (`checkpoint`: the file or
    folder the message names)."""
    payload = load_weights_only(path)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{checkpoint} is not a checkpoint written by this framework")
    return payload


# What torch's reader raises on bytes that are not its archive (a text file: KeyError).
UNREADABLE = (
    pickle.UnpicklingError,
    RuntimeError,
    EOFError,
    OSError,
    ValueError,
    KeyError,
    IndexError,
    TypeError,
    AttributeError,
)


def load_weights_only(path: Path) -> Any:
    """torch.load with weights_only: a file holding pickled objects or code is refused in one
    line naming it, and nothing in it runs."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except UNREADABLE as error:
        found = next((line for line in str(error).splitlines() if "GLOBAL" in line), None)
        if isinstance(error, pickle.UnpicklingError) and found is not None:
            raise CheckpointError(
                f"checkpoint {path} was refused: it holds pickled objects or code, not only "
                f"tensors and plain values ({found.strip()}); nothing in it was executed"
            ) from None
        raise CheckpointError(
            f"checkpoint {path} is unreadable: {unreadable_because(path)}; nothing in it was "
            "executed"
        ) from None


ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive
PICKLE_PROTOCOL = 0x80  # the first byte of a pickle of protocol 2 or later


def unreadable_because(path: Path) -> str:
    """Why torch could not read `path`, in words about the file (torch's own message speaks of
    its legacy formats and weights_only, which a damaged file has nothing to do with)."""
    try:
        with open(path, "rb") as file:
            head = file.read(4096)
    except OSError as error:
        return f"it cannot be opened ({error.strerror or error})"
    if not head:
        return "the file is empty"
    if head.count(0) == len(head):
        return "it holds only zero bytes (overwritten, or never written to the disk)"
    if head.startswith(ZIP_MAGIC):
        return "its archive is truncated or corrupted"
    if head[0] == PICKLE_PROTOCOL:
        return "it is a bare pickle, not a checkpoint (torch.save writes an archive)"
    return "it is not a checkpoint (neither a torch archive nor a pickle)"


def _read_sidecar(sidecar: Path) -> dict[str, Any]:
    try:
        record = json.loads(sidecar.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"checkpoint sidecar {sidecar} is damaged ({error})") from None
    if not (
        isinstance(record, dict)
        and isinstance(record.get("bytes"), int)
        and isinstance(record.get("sha256"), str)
    ):
        raise CheckpointError(f"checkpoint sidecar {sidecar} is damaged (no size or checksum)")
    return record


def newest_valid(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that reads back; broken ones are skipped with a warning. None when
    there is none; CheckpointError when there are checkpoints and none reads back (starting
    again from step 0 would lose the run)."""
    found = step_files(directory)
    problems = []
    for _, path in found:
        try:
            return path, read(path)
        except CheckpointError as error:
            log.warning("%s; falling back to the previous checkpoint", error)
            problems.append(str(error))
    if found:
        raise CheckpointError(
            f"none of the {len(found)} checkpoints in {directory} reads back ({problems[0]}"
            f"{' ...' if len(problems) > 1 else ''}); nothing was changed. Resume from a copy "
            "with checkpoint.resume=<file>, or start over in a new hydra.run.dir"
        )
    return None


class CheckpointSettings(Protocol):
    """checkpoint.* (framework/config/schemas.py's CheckpointConfig)."""

    every: int
    keep: int
    resume: str
    final: bool
    best: int
    async_save: bool


class CheckpointStates(Protocol):
    """What a checkpoint holds (framework/rank/state.py's StateRegistry)."""

    gathers: bool  # building the whole tensors is a collective (sharded parameters)

    def shared_state_dict(self) -> dict[str, Any]: ...
    def shard_state_dicts(self) -> dict[str, Any]: ...
    def small_state_dict(self) -> dict[str, Any]: ...
    def rank_state_dict(self) -> dict[str, Any]: ...


class Checkpointer:
    """Decides when a checkpoint is due and in which format, saves it (gathering every rank's
    state to rank 0, or each rank writing its shards) and finds the checkpoint to resume."""

    def __init__(
        self,
        cfg: CheckpointSettings,
        directory: Path,
        env: DistEnv,
        settings: dict[str, str],
        sharded: bool = False,
        compare: Compare = plainly_changed,
    ) -> None:
        self.cfg, self.env = cfg, env
        self.directory = directory
        self.settings = settings
        self.compare = compare  # a key a checkpoint lacks may still be no change
        self.sharded = sharded  # checkpoint.format, resolved for the strategy
        self.logger_ids: dict[str, str] = {}  # a restart continues these logger runs
        self.last_path: Path | None = None
        self.every = cfg.every  # asked every step
        self.in_background = sharded and cfg.async_save
        # A background save's collectives run beside training's: on a group of their own.
        self.group = (
            dist.new_group(backend="gloo") if self.in_background and env.distributed else None
        )
        self._pending: threading.Event | None = None  # set when the background save is sealed
        self._pending_error: BaseException | None = None

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def wants(self, step: int, *, ending: bool = False, final: bool = False) -> bool:
        """Whether `save` writes at `step`: every checkpoint.every steps, and at the end
        (`final`) when checkpoint.final; the run's last step (`ending`) saves only once, at the
        end, when that one comes anyway."""
        if final:
            return self.cfg.final
        return self.due(step) and not (ending and self.cfg.final)

    def save(
        self,
        step: int,
        states: CheckpointStates,
        *,
        ending: bool = False,
        final: bool = False,
        best: tuple[float, bool] | None = None,
        before: Callable[[], object] | None = None,
    ) -> Path | None:
        """Collective (every rank, at the same step, with the same arguments): the checkpoint
        of `step` when one is due (`wants`), or among the best (`best`: (score, maximize)), in
        the run's format: one file from rank 0, or every rank's shards. `before` runs first on
        every rank when one is saved. Returns where it goes, or None when none was due."""
        if best is None and not self.wants(step, ending=ending, final=final):
            return None
        if before is not None:
            before()
        if self.sharded:
            return self.write_sharded(
                step,
                states.shard_state_dicts(),
                states.small_state_dict,
                states.rank_state_dict(),
                best=best,
            )
        built = states.shared_state_dict() if states.gathers else None  # (then a collective)
        return self.write_file(
            step,
            (lambda: built) if built is not None else states.shared_state_dict,
            states.rank_state_dict(),
            best=best,
        )

    def write_file(
        self,
        step: int,
        shared: Callable[[], dict[str, Any]],
        rank_state: dict,
        best: tuple[float, bool] | None = None,
    ) -> Path:
        """Collective: every rank calls it at the same step; only rank 0 writes. `best`:
        (score, maximize) saves among the best checkpoints (checkpoint.best) instead."""
        self.finish_pending()
        states = _gather_to_main(rank_state, self.env)
        if self.env.is_main:
            payload = self._payload(step, shared(), states)
            if best is not None:
                return self._guard_save(
                    step, lambda: write_best(self.directory, step, payload, *best, self.cfg.best)
                )
            self.last_path = self._guard_save(
                step, lambda: write(self.directory, step, payload, self.cfg.keep)
            )
            log.info("checkpoint: step %d -> %s", step, self.last_path)
        return self.directory / f"step_{step:08d}.pt"

    def _payload(self, step: int, shared: dict[str, Any], states: list[Any]) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "step": step,
            "world_size": self.env.world_size,
            "config_hash": settings_hash(self.settings),
            "config": self.settings,
            "logger_ids": self.logger_ids,
            **shared,
            "ranks": states,
        }

    def write_sharded(
        self,
        step: int,
        shards: dict[str, Any],
        shared: Callable[[], dict[str, Any]],
        rank_state: dict,
        best: tuple[float, bool] | None = None,
    ) -> Path:
        """Collective: `shards` (model, optimizer, EMA: this rank's part of each) go to DCP,
        every rank writing its own; rank 0 writes the rest beside them. With
        checkpoint.async_save a periodic save returns once the shards are copied to host
        memory, and is sealed (renamed, listed in its sidecar, linked) when DCP is done."""
        self.finish_pending()
        states = _gather_to_main(rank_state, self.env)
        directory = self.directory / "best" if best else self.directory
        partial = directory / f".step_{step:08d}{sharded.SUFFIX}.partial"
        skeletons, tensors = {}, {}
        for key, state in shards.items():
            skeletons[key], found = (None, {}) if state is None else sharded.split(state, key)
            tensors.update(found)
        if self.env.is_main:
            payload = {**self._payload(step, shared(), states), "sharded": skeletons}
            self._guard_save(step, lambda: _start_partial(partial, payload))
        in_background = self.in_background and best is None
        future = self._guard_save(
            step, lambda: sharded.write_shards(partial, tensors, in_background, self.group)
        )
        final = directory / f"step_{step:08d}{sharded.SUFFIX}"

        def seal() -> None:
            if not self.env.is_main:
                return
            if best is None:
                self._guard_save(
                    step, lambda: _publish(directory, _seal(partial, step), self.cfg.keep)
                )
                self.last_path = final
                log.info("checkpoint: step %d -> %s", step, final)
                return
            score, maximize = best
            self._guard_save(step, lambda: _seal(partial, step, score=score))
            kept = _publish_best(self.directory, maximize, self.cfg.best)
            log.info("%s -> %s", best_line(step, score, kept), final)

        if future is None:
            seal()
        else:
            self._seal_when_written(step, future, seal)
        return final

    def _seal_when_written(self, step: int, future: Any, seal: Callable[[], None]) -> None:
        done = threading.Event()

        def on_written(written: Any) -> None:
            try:
                self._guard_save(step, written.result)
                seal()
            except BaseException as error:  # noqa: BLE001 (raised in the training thread, at the next save)
                self._pending_error = error
            finally:
                done.set()

        self._pending = done
        future.add_done_callback(on_written)

    def finish_pending(self) -> None:
        """Wait for a background save to be sealed (one DCP save at a time, and none may be
        cut off when the run ends); its failure is raised here."""
        if self._pending is None:
            return
        self._pending.wait()
        self._pending = None
        error, self._pending_error = self._pending_error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """On every way out of a run: a background save still being written is waited for
        (cut off, its folder would stay partial and the previous checkpoint would be used)."""
        try:
            self.finish_pending()
        except (Exception, CheckpointException) as error:  # noqa: BLE001 (the run is ending anyway)
            log.error("the last background checkpoint was not saved: %s", error)

    def _guard_save(self, step: int, save: Callable[[], Any]) -> Any:
        """`save`, with a failed write (disk full) as SaveFailed naming what is still intact."""
        try:
            return save()
        except (OSError, RuntimeError, CheckpointException) as error:  # torch.save wraps OSError
            reason = _write_failure(error)
            if reason is None:
                raise
            earlier = step_files(self.directory)
            kept = f"{earlier[0][1]} is intact" if earlier else "no earlier one was saved"
            raise SaveFailed(
                f"the checkpoint of step {step} could not be written to {self.directory} "
                f"({reason}); {kept}. Free space (or raise the file-size limit) and run the same "
                "command again to resume"
            ) from None

    def best_path(self) -> Path | None:
        """best.pt, when checkpoint.best kept one."""
        link = self.directory / "best.pt"
        return link if self.cfg.best and link.exists() else None

    def find_resume(self) -> tuple[Path, dict[str, Any]] | None:
        """Collective: rank 0 picks the file (so every rank resumes from the same one), then
        each rank reads it. Raises CheckpointError for an explicit path that is unusable."""
        choice: Path | None = None
        payload = None
        if self.env.is_main:
            choice, payload = self._choose()
        choice = broadcast_object(choice)
        if choice is None:
            return None
        if payload is None:
            payload = read(choice)
        if payload["world_size"] != self.env.world_size and self.env.is_main:
            log.warning(
                "resuming %s, written by %d ranks, on %d: the model and optimizer state are "
                "resharded and the data continue from the epoch's global position; each rank's "
                "RNG streams and comm-hook memory cannot carry over to another number of ranks, "
                "so the run continues without being bit-identical to one that kept %d ranks",
                choice,
                payload["world_size"],
                self.env.world_size,
                payload["world_size"],
            )
        differences = settings_differences(payload, self.settings, self.compare)
        if differences and self.cfg.resume == "auto":
            raise CheckpointError(
                f"{choice} was written by this run dir's run with other settings: "
                f"{_shorten(differences)}. Resume with the original settings (`train "
                f"hydra.run.dir={self.directory.parent}` takes them from the run's record), or "
                "start a new run in a new hydra.run.dir"
            )
        if differences and self.env.is_main:  # an explicit path: the user asked for this one
            log.warning(
                "continuing from %s with changed settings: %s", choice, _shorten(differences)
            )
        return choice, payload

    def _choose(self) -> tuple[Path | None, dict[str, Any] | None]:
        for folder in (self.directory, self.directory / "best"):  # from saves that were killed
            for stale in folder.glob(".*.tmp-*"):
                stale.unlink(missing_ok=True)
            for stale in folder.glob(f".step_*{sharded.SUFFIX}.partial"):
                shutil.rmtree(stale, ignore_errors=True)
        if self.cfg.resume == "never":
            return None, None
        if self.cfg.resume != "auto":
            path = Path(self.cfg.resume).expanduser()
            return path, read(path)
        found = newest_valid(self.directory)
        return found if found else (None, None)


def _start_partial(partial: Path, payload: dict[str, Any]) -> None:
    """The folder a sharded save writes into, holding rank 0's state.pt. The other ranks' DCP
    writers may create it first; partial folders of killed saves were removed at the start."""
    partial.mkdir(parents=True, exist_ok=True)
    atomic_write(partial / sharded.STATE_FILE, lambda file: torch.save(payload, file))


def _write_failure(error: BaseException) -> str | None:
    """Why a save failed, when it failed writing: the OS's reason, or what the writer of a
    rank's shards said (DCP reports each rank's failure, without the OSError behind it)."""
    if isinstance(error, CheckpointException):
        failed, _ = next(iter(error.failures.values()))
        cause = _os_error_in(failed)
        return str(cause.strerror or cause) if cause else first_line(failed)
    cause = _os_error_in(error)
    return None if cause is None else str(cause.strerror or cause)


def _os_error_in(error: BaseException | None) -> OSError | None:
    """The OSError behind `error` (itself, or what it was raised from or during)."""
    while error is not None and not isinstance(error, OSError):
        error = error.__cause__ or error.__context__
    return error


def _gather_to_main(item: Any, env: DistEnv) -> list[Any]:
    """Every rank's `item`, in rank order, on rank 0 (an empty list elsewhere)."""
    if not env.distributed:
        return [item]
    gathered: list[Any] = [None] * env.world_size if env.is_main else []
    dist.gather_object(item, gathered if env.is_main else None, dst=0)
    return gathered
