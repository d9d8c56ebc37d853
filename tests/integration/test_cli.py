"""The app as users run it: a process per command, files and exit codes checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    DIST_ENV_VARS,
    REPO,
    read_metrics,
    run_cli,
    torch_refused,
    train_losses,
)

pytestmark = pytest.mark.slow
# A few steps of the default experiment, each one logged: enough to compare losses.
QUICK = ("trainer.max_epochs=null", "trainer.max_steps=3", "trainer.log_every=1")


def run_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.glob("outputs/*/*/config.yaml"))


def test_default_experiment_reaches_95_percent_in_a_minute_only_rank_0_writes_torch_not_in_train(
    tmp_path,
):
    """The command itself never imports torch: its ranks, forked from the fork server, and the
    process that hosts their store do (framework/launch/local/store_host.py)."""
    train = Path(sys.executable).parent / "train"  # the console script from pyproject
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV_VARS}
    env["PYTHONPATH"] = torch_refused(tmp_path / "guard", spared="multiprocessing.forkserver")
    result = subprocess.run(
        [str(train)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [run_dir] = run_dirs(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["val/accuracy"] >= 0.95
    assert summary["world_size"] == 2 and summary["global_batch_size"] == 64
    assert summary["wall_s"] < 60
    last_line = result.stderr.strip().splitlines()[-1]
    assert "val/accuracy=" in last_line and "samples/s=" in last_line and str(run_dir) in last_line
    assert "global batch 64 = 32 per rank x 2 ranks" in result.stderr
    # Only rank 0 writes: one run dir, one metrics file, nothing logged by rank 1.
    assert len(list(tmp_path.rglob("metrics.jsonl"))) == 1
    assert len(list(tmp_path.rglob("summary.json"))) == 1
    assert "[rank 1]" not in result.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".hydra",
        ".lock",  # who held the run dir (docs/checkpoints.md#the-run-directory)
        "checkpoints",
        "config.yaml",
        "curves.png",
        "metrics.jsonl",
        "summary.json",
        "train.log",
    ]
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the curves
    # The final checkpoint; a single process loads the bare model from it for inference.
    final = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert final["step"] == summary["steps"]
    assert not any(key.startswith("module.") for key in final["model"])


def external_torchrun(*args: str, cwd: Path, env: dict | None = None):
    """`torchrun --nproc_per_node=2 -m framework.train ARGS`, as a user types it."""
    environ = {k: v for k, v in os.environ.items() if k not in DIST_ENV_VARS}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=localhost:0",
            "-m",
            "framework.train",
            *args,
        ],
        cwd=cwd,
        env={**environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_torchrun_gives_one_run_dir_and_the_same_losses_as_the_local_launcher(cli, tmp_path):
    temp = tmp_path / "tmp"  # (its own: another test's torchrun may hold one in /tmp now)
    temp.mkdir()
    torchrun = external_torchrun(
        *QUICK, cwd=tmp_path / ".." / tmp_path.name, env={"TMPDIR": str(temp)}
    )
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    [torchrun_dir] = run_dirs(tmp_path)  # one dir although both ranks entered the Hydra app
    assert not list(temp.glob("framework-rank*"))  # rank 1's throwaway dir is gone

    local = tmp_path / "local"
    result = cli(*QUICK, f"hydra.run.dir={local}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert train_losses(torchrun_dir) == train_losses(local)


def test_a_start_only_rank_0_refuses_leaves_no_dir_of_the_other_ranks(tmp_path):
    """A missing init file in a new run dir is rank 0's to refuse: a rank > 0 (a throwaway
    Hydra dir) cannot tell whether rank 0 resumes, so it goes on until torchrun's agent stops
    it (SIGTERM). Its throwaway dir goes with it."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    missing = tmp_path / "gone.safetensors"
    result = external_torchrun(
        *QUICK, "init=file", f"init.path={missing}", cwd=tmp_path, env={"TMPDIR": str(temp)}
    )
    assert result.returncode != 0
    assert f"error: init.path={missing} does not exist" in result.stderr
    assert not list(temp.glob("framework-rank*"))  # (torchelastic_*: the user's torchrun's)
    assert not (tmp_path / "outputs").exists()


def test_wandb_offline_makes_exactly_one_run_with_the_metrics(cli, tmp_path):
    env = {
        "WANDB_MODE": None,
        "WANDB_API_KEY": None,
        "NETRC": str(tmp_path / "no-netrc"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "CUDA_VISIBLE_DEVICES": "",  # 2 forked CPU ranks on any machine (not 1, in this process)
    }
    run_dir = tmp_path / "run"
    result = cli(*QUICK, "logger=wandb", f"hydra.run.dir={run_dir}", cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    offline_runs = list(tmp_path.rglob("offline-run-*"))
    assert len(offline_runs) == 1 and offline_runs[0].parent == run_dir / "wandb"
    assert "wandb sync" in result.stderr
    [history] = list(offline_runs[0].glob("*.wandb"))
    assert history.stat().st_size > 0
    assert read_metrics(run_dir)[-1]["val/accuracy"] > 0
    # W&B's temp folders (made in the run dir as rank 0 imports it) are gone with the rank,
    # which multiprocessing ends without the interpreter's shutdown.
    assert not list(run_dir.glob(".wandb-temp-*"))


def test_multirun_sweep_runs_each_job_in_its_own_dir(cli, tmp_path):
    result = cli(
        "-m",
        "optimizer.lr=0.1,0.05",
        "trainer.max_steps=3",
        "trainer.log_every=1",
        "launcher.nproc_per_node=1",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = sorted(tmp_path.glob("multirun/*/*/*/summary.json"))
    assert len(summaries) == 2
    lrs = [read_metrics(s.parent)[0]["lr"] for s in summaries]
    assert lrs == [0.1, 0.05]


def cifar_root(tmp_path: Path) -> Path:
    from tests.unit.test_data import make_tiny_cifar

    make_tiny_cifar(tmp_path / "cifar")
    return tmp_path / "cifar" / "cifar-10-batches-py"


def test_cifar10_experiment_trains_from_a_local_folder(cli, tmp_path):
    root = cifar_root(tmp_path)
    run_dir = tmp_path / "run"
    result = cli(
        "experiment=cifar10_resnet18",
        f"data.root={root}",
        "data.batch_size=4",
        "data.num_workers=0",
        "trainer.max_steps=2",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["global_batch_size"] == 8


BAD_INPUT = [
    (["model=resnet99"], ["model", "resnet18", "cnn", "mlp"]),
    (["optimizer.lr=abc"], ["optimizer.lr", "abc"]),
    (["trainer.unknown_key=1"], ["unknown_key"]),
    (["launcher.nproc_per_node=0"], ["launcher.nproc_per_node=0", ">= 1"]),
    (["launcher.nproc_per_node=1000"], ["far more than this", "launcher.oversubscribe=true"]),
    (["trainer.grad_accum=0"], ["trainer.grad_accum=0", ">= 1"]),
    (["data=cifar10"], ["data.root", "cifar-10-batches-py", "data.download=true"]),
    (["comm=powersgd", "comm.rank=0"], ["comm.rank=0", ">= 1"]),
    (["comm=powersgd", "comm.start_iter=-1"], ["comm.start_iter=-1", ">= 0"]),
    (
        ["strategy=fsdp", "comm=powersgd"],
        ["error: comm=powersgd", "strategy=fsdp", "comm=allreduce"],
    ),
    (["precision=fp8"], ["precision/fp8", "amp", "bf16", "fp32"]),
    (
        ["data=synthetic", "data.train_size=16", "data.val_size=4"],
        ["the training set (16 samples) is smaller than one global batch", "data.batch_size"],
    ),
    (["comm=powersgd", "comm.compress=fp8"], ["comm.compress='fp8'", "not one of 'fp16', 'bf16'"]),
    (["trainer.on_nonfinite=ignore"], ["trainer.on_nonfinite=ignore", "one of [stop, skip]"]),
    (
        ["trainer.max_step=5"],
        ["trainer.max_step is not a setting: did you mean trainer.max_steps?"],
    ),
    (["launcher=torchrun", "launcher.nnodes=2:1"], ["launcher.nnodes=2:1", "MIN:MAX"]),
    (["launcher=torchrun", "launcher.nnodes=1:2"], ["elastic range", "launcher.max_restarts>=1"]),
    (
        ["launcher=torchrun", "launcher.nnodes=2", "launcher.rdzv_endpoint=node0:29500"],
        ["give every node the same hydra.run.dir"],
    ),
    (["launcher=torchrun", "launcher.nnodes=2"], ["port 0 picks a free port on one node"]),
    (["+trainer.max_step=5"], ["did you mean trainer.max_steps?"]),
    (["+model.hiden=3"], ["model.hiden is not a setting of", "it takes in_channels"]),
]


@pytest.mark.parametrize(("overrides", "expected"), BAD_INPUT, ids=lambda v: str(v))
def test_bad_input_exits_nonzero_with_one_clear_message_and_no_run_dir(
    cli, tmp_path, overrides, expected
):
    result = cli(*overrides, cwd=tmp_path)
    assert result.returncode == 2  # one code for every config mistake, Hydra's own included
    for text in expected:
        assert text in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    # One short message: Hydra's lists of options (tab-indented) grow with the config groups.
    lines = result.stderr.strip().splitlines()
    assert len([line for line in lines if not line.startswith("\t")]) <= 10
    assert not (tmp_path / "outputs").exists()


def test_hydra_config_mistakes_are_one_error_line_with_exit_2(cli, tmp_path):
    """framework/app/hydra_errors.py against the installed Hydra: its composition error comes
    back as one `error:` line with OmegaConf's reason, and HYDRA_FULL_ERROR is left as it was."""
    result = cli("dist.backend=mpi", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: Error merging override dist.backend=mpi: Invalid value 'mpi', expected one of "
        "[auto, gloo, nccl]"
    ]
    assert "HYDRA_FULL_ERROR" not in os.environ


@pytest.mark.parametrize(
    ("sweep", "expected"),
    [([], "You must specify 'model'"), (["-m"], "Missing mandatory value: model")],
    ids=["run", "sweep"],
)
def test_a_missing_group_default_is_one_line_with_exit_2(cli, tmp_path, sweep, expected):
    """A primary config with `model: ???` and a run dir that reads the model: Hydra skips the
    group while it composes a sweep's master config (and while it finds the run mode), so the
    checks of Hydra's node meet a missing choice before Hydra refuses the composition."""
    config = (REPO / "conf" / "config.yaml").read_text().replace("- model: cnn", "- model: ???")
    run_dir = "dir: ${output_dir:${mode},${checkpoint.resume},${eval.split}}"
    assert run_dir in config
    config = config.replace(run_dir, "dir: outputs/${model.width}")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "mine.yaml").write_text(config)
    result = cli(*sweep, "-cd", str(tmp_path / "conf"), "-cn", "mine", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert expected in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()


def test_hydra_full_error_still_shows_hydras_traceback(tmp_path):
    result = run_cli("dist.backend=mpi", cwd=tmp_path, env={"HYDRA_FULL_ERROR": "1"})
    assert result.returncode == 1  # the exception escaped, as Hydra documents for this switch
    assert "Traceback" in result.stderr and "ConfigCompositionException" in result.stderr
    assert not (tmp_path / "outputs").exists()


def test_hydras_own_commands_answer_whatever_has_been_typed(cli, tmp_path):
    """Hydra's -sc reads its own arguments (install=bash, query=bash), not overrides, and tab
    completion must answer a command line that does not compose yet; --hydra-help composes no
    app config at all."""
    hydra_help = cli("--hydra-help", "-cn", "nonexist", cwd=tmp_path)
    assert hydra_help.returncode == 0 and "Hydra (" in hydra_help.stdout, hydra_help.stderr
    installed = cli("-sc", "install=bash", cwd=tmp_path)
    assert installed.returncode == 0 and "hydra_bash_completion()" in installed.stdout
    typed = {"COMP_LINE": "train data.batch_size=abc mod"}
    query = cli("-sc", "query=bash", cwd=tmp_path, env=typed)
    assert query.returncode == 0 and query.stdout.split() == ["model="], query.stderr


def test_an_existing_run_dir_without_checkpoints_is_refused_and_left_untouched(cli, tmp_path):
    """(One with checkpoints is resumed instead: tests/integration/test_faults.py.)"""
    run_dir = tmp_path / "run"
    first = cli(
        "trainer.max_steps=2",
        "launcher.nproc_per_node=1",
        f"hydra.run.dir={run_dir}",
        "checkpoint.final=false",
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    second = cli("trainer.max_steps=5", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert second.returncode != 0 and "hydra.run.dir" in second.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_readme_starts_with_the_two_commands():
    lines = [line for line in (REPO / "README.md").read_text().splitlines() if line.strip()]
    commands = [line for line in lines[:12] if line.startswith("uv run")]
    assert commands[:2] == ["uv run train", "uv run pytest"]


def test_bring_your_own_model_and_dataset_through_target(cli, tmp_path):
    byo = Path(__file__).parent / "byo"
    run_dir = tmp_path / "run"
    result = cli(
        f"hydra.searchpath=[file://{byo}]",
        "model=my_net",
        "data=my_data",
        "model.depth=3",
        "trainer.max_epochs=2",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    config = (run_dir / "config.yaml").read_text()
    assert "TinyNet" in config and "depth: 3" in config
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 8  # 64/(8*2) x 2


def test_a_constructor_that_refuses_its_settings_is_one_line_naming_where(cli, tmp_path):
    """What no rule knows before torch (a project's own model's own check): the constructor's
    error, met by the trial before any rank starts (framework/rank/preflight.py, in a process
    forked from the fork server), as the one line the command prints, exit 2, no run dir."""
    byo = Path(__file__).parent / "byo"
    result = cli(
        f"hydra.searchpath=[file://{byo}]",
        "model=my_net",
        "data=my_data",
        "model.depth=0",
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 2, result.stderr[-3000:]
    # One line in all: not the rank's start-up lines (the layout naming a run dir that is then
    # removed, `Instantiating ...`) before it.
    errors = result.stderr.splitlines()
    raised_at = Path(__file__).parent / "byo_components.py"
    line = next(
        number
        for number, text in enumerate(raised_at.read_text().splitlines(), 1)
        if "raise ValueError" in text
    )
    assert errors == [
        "error: model: tests.integration.byo_components.TinyNet(num_classes=2, in_channels=2, "
        "depth=0) refused its settings: ValueError: depth must be at least 1, got 0 (raised at "
        f"{raised_at}:{line}): check model's settings"
    ]
    assert list(tmp_path.iterdir()) == []


def test_a_torch_optimizer_that_refuses_its_settings_is_one_line(cli, tmp_path):
    """A torch optimizer no rule of ours knows (RMSprop's alpha): torch's own check, one line."""
    rmsprop = ["optimizer._target_=torch.optim.RMSprop", "~optimizer.nesterov", "~optimizer.fused"]
    result = cli("launcher.nproc_per_node=1", *rmsprop, "+optimizer.alpha=-1", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        "error: optimizer: torch.optim.RMSprop(lr=0.1, weight_decay=0.0005, momentum=0.9, "
        "alpha=-1) refused its settings: ValueError: Invalid alpha value: -1: check "
        "optimizer's settings"
    ]
    assert list(tmp_path.iterdir()) == []


def test_a_run_composes_its_config_once_and_a_sweep_each_job_once(cli, tmp_path, monkeypatch):
    """The composition the checks judge is the one Hydra runs (framework/app/composition.py):
    a run composes its config once, and the shipped Hydra node it is compared with; a sweep its
    master, that node, and each job once (Hydra's sweeper and launcher both ask for it)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    from framework.app import shipped_node

    composed = []
    compose = ConfigLoaderImpl.load_configuration

    def counted(self, *args, **kwargs):
        composed.append(args)
        return compose(self, *args, **kwargs)

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", counted)
    shipped_node._shipped_node.cache_clear()  # (composed once a process: here, once a command)
    one_rank = ("launcher.nproc_per_node=1", "trainer.max_steps=1", "trainer.max_epochs=null")
    run = cli(*one_rank, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(composed) == 2
    composed.clear()
    shipped_node._shipped_node.cache_clear()
    sweep = cli("-m", "optimizer.lr=0.1,0.05", *one_rank, cwd=tmp_path)
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    assert len(composed) == 4
