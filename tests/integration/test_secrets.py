"""Every writer fed a planted secret: values read from the environment through `${oc.env:...}`,
under a secret-looking key, and in a URL's userinfo reach no file of the run (or sweep) dir, no
logger's store (W&B's .wandb, TensorBoard's events, MLflow's database) and no console output
(docs/security.md, "Secrets")."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from framework.config.redaction import REDACTED
from framework.core.exits import ExitCode
from tests.conftest import REPO

pytestmark = pytest.mark.slow

TINY_RUN = (
    f"hydra.searchpath=[file://{REPO / 'tests' / 'conf'}]",
    "launcher.nproc_per_node=1",
    "trainer.max_steps=2",
    "trainer.log_every=1",
    "data=user_settings",
    "data.train_size=32",
    "data.val_size=16",
    "data.in_channels=1",
    "data.image_size=8",
)
# Environment variables whose names are not secret-looking: only reading them through
# ${oc.env:...} makes their values secrets.
ENV_SECRETS = {
    "PGPASSWORD": "PLANTED-PGPASSWORD-1",
    "GITHUB_PAT": "PLANTED-GITHUB-PAT-2",
    "DB_PASS": "PLANTED-DB-PASS-3",
    "MY_SERVICE": "PLANTED-MY-SERVICE-4",
}
TOKEN = "PLANTED-API-TOKEN-5"  # under a secret-looking key, typed on the command line
URL_PASSWORD = "PLANTED/URL-PASSWORD-6"  # a URL's password, holding a '/'
SERVER_PASSWORD = "PLANTED-SERVER-PASSWORD-9"  # an MLflow server's, in its URI
SWEPT = ("PLANTED-SWEPT-TOKEN-7", "PLANTED-SWEPT-TOKEN-8")  # a swept secret-looking key
WANDB_KEY = "PLANTED-WANDB-API-KEY-10"  # the environment's WANDB_API_KEY, read by W&B itself
PLANTED = [*ENV_SECRETS.values(), TOKEN, URL_PASSWORD, SERVER_PASSWORD, *SWEPT, WANDB_KEY]

# Every writer at once: the four loggers, the values in W&B's and MLflow's names, group and
# tags, in the config (config.yaml, W&B's config, MLflow's params) and in a URL.
EVERY_WRITER = (
    "logger=[wandb,tensorboard,csv,mlflow]",
    "logger.wandb.run_name=${oc.env:PGPASSWORD}",
    "logger.wandb.group=${oc.env:DB_PASS}",
    "logger.wandb.tags=[${oc.env:GITHUB_PAT}]",
    "logger.mlflow.run_name=${oc.env:MY_SERVICE}",
    "+data.note=${oc.env:GITHUB_PAT}",
    "+data.owner=x-${oc.env:PGPASSWORD}-y",
    f"+data.mirror=https://bob:{URL_PASSWORD}@example.com/data",
)


def environment(tmp_path: Path) -> dict[str, str]:
    return {
        **ENV_SECRETS,
        "WANDB_MODE": "offline",
        "WANDB_API_KEY": WANDB_KEY,
        "NETRC": str(tmp_path / "no-netrc"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }


def leaks(root: Path, console: str) -> list[str]:
    """Where a planted secret was found: every file under root, read as bytes, and the console."""
    found = [
        f"{path.relative_to(root)}: {secret}"
        for path in sorted(root.rglob("*"))
        if path.is_file()
        for secret in PLANTED
        if secret.encode() in path.read_bytes()
    ]
    return found + [f"console: {secret}" for secret in PLANTED if secret in console]


def test_a_run_with_every_logger_writes_no_planted_secret(cli, tmp_path):
    run_dir = tmp_path / "run"
    result = cli(
        *EVERY_WRITER,
        f"+data.api_token={TOKEN}",
        *TINY_RUN,
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        env=environment(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # Every writer wrote (a walk of an empty dir would prove nothing).
    for pattern in (
        "config.yaml",
        ".hydra/config.yaml",
        ".hydra/hydra.yaml",
        ".hydra/overrides.yaml",
        "train.log",
        "metrics.jsonl",
        "metrics.csv",
        "summary.json",
        "tensorboard/events.out.tfevents.*",
        "wandb/offline-run-*/*.wandb",
    ):
        assert list(run_dir.glob(pattern)), pattern
    assert (tmp_path / "mlflow.db").exists()
    assert leaks(tmp_path, result.stdout + result.stderr) == []
    # The secret-looking key is kept, redacted: in both records and in W&B's copy of the config.
    assert OmegaConf.load(run_dir / "config.yaml").data.api_token == REDACTED
    assert OmegaConf.load(run_dir / ".hydra" / "config.yaml").data.api_token == REDACTED
    assert sorted(p.name for p in (run_dir / ".hydra").iterdir()) == [
        "config.yaml",
        "hydra.yaml",
        "overrides.yaml",
    ]
    [history] = run_dir.glob("wandb/offline-run-*/*.wandb")  # (its names are redacted too)
    assert f'"api_token":"{REDACTED}"'.encode() in history.read_bytes()


def test_a_sweep_with_every_logger_writes_no_planted_secret(cli, tmp_path):
    sweep_dir = tmp_path / "sweep"
    result = cli(
        "-m",
        *EVERY_WRITER,
        f"+data.api_token={SWEPT[0]},{SWEPT[1]}",
        *TINY_RUN,
        f"hydra.sweep.dir={sweep_dir}",
        cwd=tmp_path,
        env=environment(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for pattern in ("multirun.yaml", "summary.csv", "summary.md", "*/config.yaml", "*/train.log"):
        assert len(list(sweep_dir.glob(pattern))) == (2 if "/" in pattern else 1), pattern
    assert len(list(sweep_dir.glob("*/wandb/offline-run-*/*.wandb"))) == 2
    assert "Launching 2 jobs" in result.stdout + result.stderr  # Hydra's console lines too
    assert leaks(tmp_path, result.stdout + result.stderr) == []


# --- what the command prints ------------------------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [
        ("--cfg", "job", "--resolve"),
        ("--help", "--resolve"),
    ],
    ids=["cfg-resolve", "help-resolve"],
)
def test_printing_the_config_shows_no_secret(cli, tmp_path, args):
    result = cli(
        *args,
        *TINY_RUN,  # a data option of the user's that takes any key (what is shown is checked)
        "+data.note=${oc.env:PGPASSWORD}",
        f"+data.api_token={TOKEN}",
        f"+data.mirror=https://bob:{URL_PASSWORD}@example.com/data",
        cwd=tmp_path,
        env=ENV_SECRETS,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mirror: https://bob:***REDACTED***@example.com/data" in result.stdout
    assert leaks(tmp_path, result.stdout + result.stderr) == []


@pytest.mark.parametrize("name", ["HF_TOKEN", "PGPASSWORD"])
def test_a_one_line_error_quotes_no_secret(cli, tmp_path, name):
    result = cli(
        f"trainer.max_steps=${{oc.env:{name}}}",
        cwd=tmp_path,
        env={name: "PLANTED-PGPASSWORD-1"},
    )
    assert result.returncode == ExitCode.CONFIG_REJECTED, result.stderr[-3000:]
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "trainer.max_steps" in result.stderr and "***REDACTED***" in result.stderr
    assert leaks(tmp_path, result.stdout + result.stderr) == []


def test_an_unreachable_mlflow_server_is_one_line_without_its_password_within_seconds(
    cli, tmp_path
):
    """MLflow's own retries, untouched by the environment, took 271 s and printed 7 lines: the
    run's start waits for one answer only (60 s is a bound, not a measurement)."""
    started = time.monotonic()
    result = cli(
        "logger=mlflow",
        f"logger.mlflow.tracking_uri=http://bob:{SERVER_PASSWORD}@127.0.0.1:9",
        *TINY_RUN,
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        env={"MLFLOW_HTTP_REQUEST_MAX_RETRIES": None, "MLFLOW_HTTP_REQUEST_TIMEOUT": None},
    )
    assert time.monotonic() - started < 60
    assert result.returncode == ExitCode.CONFIG_REJECTED, result.stderr[-3000:]
    [line] = result.stderr.strip().splitlines()
    assert "logger.mlflow.tracking_uri" in line and "MLflow could not start a run" in line
    assert "http://bob:***REDACTED***@127.0.0.1:9" in line
    assert not (tmp_path / "run").exists()
    assert leaks(tmp_path, result.stdout + result.stderr) == []
