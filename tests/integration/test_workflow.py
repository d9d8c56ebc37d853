"""The workflow around a run, as users meet it: the best checkpoints, early stopping, a test split
tested with the best weights, evaluating a checkpoint (mode=eval), the loggers (TensorBoard, CSV,
MLflow with real libraries and a local sqlite store) resumed into the same runs, profiling, and
optimizer parameter groups."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from framework.config.redaction import REDACTED
from framework.core.exits import ExitCode
from tests.conftest import FAULTS, make_cfg, read_metrics, train_many
from tests.faults import FAULT_ENV

pytestmark = pytest.mark.slow
# 4 steps per epoch of the digits set on 2 ranks x batch 128; evaluations every 4 steps.
WORKFLOW = (
    "data.batch_size=128",
    "trainer.max_epochs=null",
    "trainer.max_steps=24",
    "trainer.eval_every=4",
    "trainer.log_every=2",
    "data.test_fraction=0.1",
    "checkpoint.best=2",
    "checkpoint.every=8",
)

# AdamW's four parameter groups (decay or not, the head at 10x the lr) on the cosine schedule,
# profiled at steps 3-4; a checkpoint at step 3 to resume from.
GROUPS = (
    *WORKFLOW,
    "optimizer=adamw",
    "+optimizer.lr_multipliers={head.*:10.0}",
    "trainer.profile_steps=[3,4]",
    "trainer.max_steps=6",
    "checkpoint.best=0",
    "checkpoint.every=3",
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One pair of rank processes: a run with best checkpoints and a test split, one that
    stops early, and one with the profiler and parameter groups."""
    root = tmp_path_factory.mktemp("workflow")
    jobs = {
        "best": WORKFLOW,
        # lr 0 from the start: nothing improves, so the third evaluation without improvement
        # (step 16) ends the run.
        "early": (
            *WORKFLOW,
            "optimizer.lr=1e-12",
            "trainer.early_stopping.patience=2",
            "trainer.early_stopping.min_delta=1e-3",
            "objective=val/loss",
        ),
        "groups": GROUPS,
    }
    summaries = train_many(
        [(make_cfg(*overrides), root / name) for name, overrides in jobs.items()]
    )
    return {name: (summary, root / name) for name, summary in zip(jobs, summaries, strict=True)}


def scores(run_dir: Path) -> dict[int, float]:
    return {e["step"]: e["val/accuracy"] for e in read_metrics(run_dir) if "val/accuracy" in e}


def test_the_best_checkpoints_are_kept_by_the_objective_and_best_pt_is_the_best(runs):
    _, run_dir = runs["best"]
    by_step = scores(run_dir)
    assert sorted(by_step) == [4, 8, 12, 16, 20, 24]  # step 24's evaluation is the final one
    best_files = sorted((run_dir / "checkpoints" / "best").glob("step_*.pt"))
    kept = {
        int(p.stem.split("_")[1]): json.loads(p.with_suffix(".json").read_text())["score"]
        for p in best_files
    }
    assert len(kept) == 2
    assert sorted(kept.values(), reverse=True) == sorted(by_step.values(), reverse=True)[:2]
    best = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    assert by_step[best["step"]] == max(by_step.values())
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*.pt")) == [
        "step_00000008.pt",
        "step_00000016.pt",
        "step_00000024.pt",
    ]  # as without best


def test_a_test_split_is_tested_with_the_best_weights_at_the_end(runs):
    summary, run_dir = runs["best"]
    best = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    assert summary["test/weights"] == f"best checkpoint (step_{best['step']:08d}.pt)"
    assert 0 < summary["test/accuracy"] <= 1 and summary["test/loss"] > 0
    last = read_metrics(run_dir)[-1]
    assert last["test/accuracy"] == summary["test/accuracy"]


def test_early_stopping_ends_every_rank_at_one_step_saves_and_says_why(runs):
    summary, run_dir = runs["early"]
    assert summary["steps"] == 12  # evaluations at 4 (best), 8 and 12: 2 without improvement
    assert (
        "early stopping: val/loss did not improve by 0.001 for 2 evaluations"
        in (summary["stopped_early"])
    )
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"] == 12
    assert "early stopping: val/loss" in (run_dir / "train.log").read_text()
    # The final evaluation is step 12's, logged once.
    assert [e["step"] for e in read_metrics(run_dir) if "val/loss" in e] == [4, 8, 12]


def test_parameter_groups_without_decay_on_biases_and_with_lr_multipliers(runs):
    _, run_dir = runs["groups"]
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    groups = saved["optimizer"]["param_groups"]
    # AdamW's default: no decay on 1-D parameters; the head at 10x the lr comes after.
    assert [(g["weight_decay"], len(g["params"])) for g in groups] == [
        (0.01, 3),
        (0.0, 3),
        (0.01, 1),
        (0.0, 1),
    ]
    assert groups[2]["initial_lr"] == pytest.approx(10 * groups[0]["initial_lr"])
    # The start-up lines say what each group holds.
    assert (
        "optimizer parameters: group 0: 55,584 parameters in 3 tensors (lr=0.001, "
        "weight_decay=0.01); group 1: 160 parameters in 3 tensors (lr=0.001, weight_decay=0); "
        "group 2: 640 parameters in 1 tensor (lr=0.01, weight_decay=0.01); group 3: 10 "
        "parameters in 1 tensor (lr=0.01, weight_decay=0)"
    ) in (run_dir / "train.log").read_text()
    trace = next((run_dir / "profile").glob("*.pt.trace.json"))
    assert "traceEvents" in json.loads(trace.read_text())


def test_a_run_with_several_lr_groups_resumed_from_step_3_ends_with_the_straight_runs_state(
    runs, tmp_path
):
    """The run above, resumed from its step 3 checkpoint into a new run dir on the cosine
    schedule: steps 4-6 log the same losses, and its last checkpoint holds the same weights,
    the same AdamW state and the same lr in each of the four groups, bit for bit."""
    _, straight_dir = runs["groups"]
    step_3 = straight_dir / "checkpoints" / "step_00000003.pt"
    resumed_dir = tmp_path / "resumed"
    train_many([(make_cfg(*GROUPS, f"checkpoint.resume={step_3}"), resumed_dir)])
    logged = {
        e["step"]: (e["train/loss"], e["lr"]) for e in read_metrics(straight_dir) if "lr" in e
    }
    assert {
        e["step"]: (e["train/loss"], e["lr"]) for e in read_metrics(resumed_dir) if "lr" in e
    } == {step: logged[step] for step in (4, 6)}
    straight, resumed = (
        torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
        for run_dir in (straight_dir, resumed_dir)
    )
    assert resumed["step"] == straight["step"] == 6
    assert_equal_tensors(resumed["model"], straight["model"])
    assert_equal_tensors(resumed["optimizer"]["state"], straight["optimizer"]["state"])
    groups = [(g["initial_lr"], g["lr"]) for g in straight["optimizer"]["param_groups"]]
    assert [(g["initial_lr"], g["lr"]) for g in resumed["optimizer"]["param_groups"]] == groups
    initial_lrs = [initial_lr for initial_lr, _ in groups]
    assert initial_lrs == pytest.approx([1e-3, 1e-3, 1e-2, 1e-2])  # the head's groups at 10x
    assert resumed["scheduler"] == straight["scheduler"]


def assert_equal_tensors(got, expected, where: str = "") -> None:
    """Two nested dicts of tensors and plain values, equal bit for bit."""
    if isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected), where
    elif isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        for key, value in expected.items():
            assert_equal_tensors(got[key], value, f"{where}/{key}")
    else:
        assert got == expected, where


def test_mode_eval_of_a_checkpoint_equals_the_runs_own_evaluation_and_writes_beside_it(
    cli, runs, tmp_path
):
    summary, run_dir = runs["best"]
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    checkpoints = run_dir / "checkpoints"
    test = cli(
        *WORKFLOW,
        "mode=eval",
        f"checkpoint.resume={checkpoints / 'best.pt'}",
        "eval.split=test",
        cwd=tmp_path,
    )
    assert test.returncode == 0, test.stderr[-3000:]
    val = cli(*WORKFLOW, "mode=eval", f"checkpoint.resume={checkpoints / 'last.pt'}", cwd=tmp_path)
    assert val.returncode == 0, val.stderr[-3000:]
    [test_dir] = (run_dir / "eval").glob("test-*")
    [val_dir] = (run_dir / "eval").glob("val-*")
    evaluated = json.loads((test_dir / "summary.json").read_text())
    assert evaluated["test/accuracy"] == summary["test/accuracy"]  # the same best weights
    assert (
        json.loads((val_dir / "summary.json").read_text())["val/accuracy"]
        == (summary["val/accuracy"])
    )  # the final weights, 2 ranks, exactly
    assert {p: p.read_bytes() for p in before} == before  # the run's own files are untouched
    assert (val_dir / ".hydra" / "config.yaml").exists() and (val_dir / "train.log").exists()


def test_mode_eval_with_other_model_settings_is_refused_naming_the_run_command(cli, runs, tmp_path):
    _, run_dir = runs["best"]
    evals_before = sorted((run_dir / "eval").glob("*")) if (run_dir / "eval").exists() else []
    result = cli(
        *WORKFLOW,
        "model.width=16",
        "mode=eval",
        "launcher.nproc_per_node=1",
        f"checkpoint.resume={run_dir / 'checkpoints' / 'last.pt'}",
        cwd=tmp_path,
    )
    assert result.returncode == ExitCode.CONFIG_REJECTED, result.stderr[-3000:]
    # One error line: not the rank's start-up lines, which wait until the checkpoint fits.
    assert result.stderr.splitlines() == [
        next(line for line in result.stderr.splitlines() if line.startswith("error: "))
    ]
    assert "model.width: 32 in the checkpoint, 16 now" in result.stderr
    evals_after = sorted((run_dir / "eval").glob("*")) if (run_dir / "eval").exists() else []
    assert evals_after == evals_before  # its own eval dir was removed again


def test_mode_eval_takes_the_training_runs_settings_from_its_record(cli, tmp_path):
    """Trained with its own data and model settings on 1 rank; evaluated on 2 ranks with only
    mode=eval, the checkpoint and a batch size: the run's own numbers."""
    run_dir = tmp_path / "run"
    trained = cli(
        "data=synthetic",
        "data.train_size=64",
        "data.val_size=29",
        "data.in_channels=1",
        "data.image_size=8",
        "model.width=8",
        "launcher.nproc_per_node=1",
        "trainer.max_epochs=null",
        "trainer.max_steps=4",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    checkpoint = run_dir / "checkpoints" / "last.pt"
    result = cli(
        "mode=eval", f"checkpoint.resume={checkpoint}", "data.eval_batch_size=7", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        f"the training run's settings from {run_dir / '.hydra' / 'overrides.yaml'}" in result.stderr
    )
    [eval_dir] = (run_dir / "eval").glob("val-*")
    evaluated = json.loads((eval_dir / "summary.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert evaluated["world_size"] == 2 and summary["world_size"] == 1
    assert evaluated["val/accuracy"] == summary["val/accuracy"]
    # Summed in float64; each sample's loss may round differently in another batch size.
    assert evaluated["val/loss"] == pytest.approx(summary["val/loss"], rel=1e-6)
    # An override of its own for a training setting is still compared, and refused.
    refused = cli("mode=eval", f"checkpoint.resume={checkpoint}", "model.width=16", cwd=tmp_path)
    assert refused.returncode == ExitCode.CONFIG_REJECTED
    assert "model.width: 8 in the checkpoint, 16 now" in refused.stderr


LOGGERS = ("logger=[tensorboard,csv,mlflow]",)


def test_tensorboard_csv_and_mlflow_get_every_metric_and_resume_into_the_same_runs(cli, tmp_path):
    """Stopped by SIGTERM at step 10 and run again: one MLflow run, one CSV and one
    TensorBoard log holding steps 1-30 once, as metrics.jsonl does. The signal reaches rank 0
    (the ranks stop together all the same: tests/integration/test_faults.py), so the stopped
    command runs in this process too."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"  # a local store: named by the environment
    args = (
        *FAULTS,
        *LOGGERS,
        f"hydra.run.dir={tmp_path / 'run'}",
        "data._target_=tests.user_data.synthetic_with_settings",  # a user's loader, with a token
        "+data.api_token=PLANTED-SECRET-1",
    )
    fault = {FAULT_ENV: "SIGTERM:0:9", "MLFLOW_TRACKING_URI": store}
    stopped = cli(*args, cwd=tmp_path, env=fault)
    assert stopped.returncode == ExitCode.STOPPED, stopped.stderr[-3000:]
    resumed = cli(*args, cwd=tmp_path, env={FAULT_ENV: None, "MLFLOW_TRACKING_URI": store})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run_dir = tmp_path / "run"
    steps = list(range(1, 31))
    jsonl = {e["step"]: e["train/loss"] for e in read_metrics(run_dir) if "train/loss" in e}
    assert list(jsonl) == steps

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == steps
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(list(jsonl.values()))

    rows = (run_dir / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    train_rows = [r.split(",") for r in rows[1:] if r.split(",")[header.index("train/loss")]]
    assert [int(r[header.index("step")]) for r in train_rows] == steps

    client = MlflowClient(store)
    [run] = client.search_runs([client.get_experiment_by_name("framework").experiment_id])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted({m.step for m in history}) == steps  # both commands log into the one run
    assert run.data.params["data.api_token"] == f'"{REDACTED}"'
    assert run.data.params["trainer.max_steps"] == "30"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"curves.png", "summary.json"} <= artifacts


def test_wandb_dir_is_honoured(cli, tmp_path):
    run_dir, wandb_dir = tmp_path / "run", tmp_path / "elsewhere"
    result = cli(
        "logger=wandb",
        "trainer.max_steps=2",
        "launcher.nproc_per_node=1",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        env={"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_API_KEY": None},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert list(wandb_dir.glob("wandb/offline-run-*")) and not (run_dir / "wandb").exists()


# --- mistakes that slipped through -----------------------------------------------------------
MISTAKES = [
    (
        [f"hydra.searchpath=[file://{Path(__file__).parent / 'nope'}]"],
        ["hydra.searchpath", "nope is not a folder of config files"],
    ),
    (
        ["+trainer.max_step=20"],
        ["trainer.max_step is not a setting: did you mean trainer.max_steps?"],
    ),
    (["model=resnet99"], ["model", "resnet18"]),  # Hydra's own: exits 2 like ours
    (["optimizer.lr=abc"], ["optimizer.lr", "abc"]),
    (["mode=eval"], ["mode=eval evaluates a checkpoint: set checkpoint.resume="]),
    (["trainer.early_stopping.patience=3"], ["trainer.eval_every"]),
    (
        ["+optimizer.lr_multipliers={nothing.*:2.0}", "launcher.nproc_per_node=1"],
        ["optimizer.lr_multipliers: nothing.* matches no parameter"],
    ),
]


@pytest.mark.parametrize(("overrides", "expected"), MISTAKES, ids=lambda v: " ".join(v)[:60])
def test_a_mistake_exits_2_with_its_message_and_no_run_dir(cli, tmp_path, overrides, expected):
    result = cli(*overrides, "trainer.max_steps=1", cwd=tmp_path)
    assert result.returncode == ExitCode.CONFIG_REJECTED, result.stderr[-3000:]
    for text in expected:
        assert text in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "outputs").exists()


def test_a_data_option_without_a_target_is_refused_before_the_run_dir(cli, tmp_path):
    options = tmp_path / "conf" / "data"
    options.mkdir(parents=True)
    (options / "mine.yaml").write_text("defaults:\n  - /schema/data/base@_here_\nbatch_size: 8\n")
    result = cli(f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "data=mine", cwd=tmp_path)
    assert result.returncode == ExitCode.CONFIG_REJECTED
    assert "error: data._target_ is not set" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "outputs").exists()


def test_help_lists_the_groups_users_pick_from_and_no_schema(cli, tmp_path):
    result = cli("--help", cwd=tmp_path)
    assert result.returncode == 0
    groups = result.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert "task: autoencoder, classification, language_model, regression" in groups
    assert "logger: csv, mlflow, none, tensorboard, wandb" in groups
    assert "schema" not in groups
