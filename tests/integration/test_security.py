"""The CLI refuses targets that would run code, and a sweep's planted secrets reach none of its
files (docs/security.md). A single run with every logger, W&B's API key included:
tests/integration/test_secrets.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from framework.config.redaction import REDACTED
from tests.conftest import REPO

pytestmark = pytest.mark.slow
TINY_RUN = (
    f"hydra.searchpath=[file://{REPO / 'tests' / 'conf'}]",
    "launcher.nproc_per_node=1",
    "trainer.max_steps=3",
    "data=user_settings",
    "data.train_size=64",
    "data.val_size=32",
    "data.in_channels=1",
    "data.image_size=8",
)
TOKEN = "PLANTED-SECRET-123"  # a config key that looks like a secret, typed on the command line
WANDB_KEY = "PLANTED-SECRET-456"  # the environment's WANDB_API_KEY

# Each target would copy src.txt to `marker` or create it (paths relative to the run's cwd).
REFUSED = [
    (
        ["+model.evil={_target_:builtins.open,file:marker,mode:w}"],
        "model.evil._target_=builtins.open is not allowed",
    ),
    (
        ["+hydra.callbacks.evil={_target_:shutil.copy,src:src.txt,dst:marker}"],
        "hydra.callbacks.evil._target_=shutil.copy is not allowed",
    ),
    (
        ["+data.evil={_target_:os.system,command:'touch marker'}"],
        "data.evil._target_=os.system is not allowed",
    ),
    (
        ["+hydra.hydra_logging.handlers.evil={\\(\\):shutil.copy,src:src.txt,dst:marker}"],
        "hydra.hydra_logging.handlers.evil.()=shutil.copy is not allowed",
    ),
    (
        ["+model.evil={_target_:torchvision.datasets.mnist.shutil.copy,src:src.txt,dst:marker}"],
        "outside the allowed families",
    ),
    (
        [
            "-m",
            "optimizer.lr=0.1,0.05",
            "+hydra.callbacks.evil={_target_:shutil.copy,src:src.txt,dst:marker}",
        ],
        "hydra.callbacks.evil._target_=shutil.copy is not allowed",
    ),
    (
        ["allowed_targets=[builtins]", "+model.evil={_target_:builtins.open,file:marker,mode:w}"],
        "allowed_targets cannot be set on the command line",
    ),
    # A private torch function that execs its argument, from every entry point.
    (
        [
            "+model.evil={_target_:torch.fx.graph_module._exec_with_source,"
            "src:\"open('marker','w')\",globals:{}}"
        ],
        "model.evil._target_=torch.fx.graph_module._exec_with_source is not allowed",
    ),
    (["-cd", "evil_conf", "model=evil"], "names a private (`_`) module"),
    (["-cd", "evil_conf", "experiment=evil_callback"], "hydra.callbacks.evil._target_="),
    (["-cd", "evil_conf", "experiment=evil_logging"], "hydra.hydra_logging.handlers.evil.()"),
    (["-cd", "evil_conf", "-m", "experiment=evil_callback,evil_logging"], "is not allowed here"),
    (
        ["-cd", "evil_conf", "experiment=trusts_torch", "model=evil"],
        "allowed_targets entry 'torch' is refused",
    ),
    # Files outside the run dir, through a logger's settings.
    (["logger=csv", "logger.csv.filename=../marker"], "logger.csv.filename=../marker must be"),
    (
        ["logger=mlflow", "logger.mlflow.tracking_uri=sqlite:///marker"],
        "logger.mlflow.tracking_uri=sqlite:///marker is a local store",
    ),
]
EXEC = "_target_: torch.fx.graph_module._exec_with_source\nsrc: open('marker', 'w')\nglobals: {}\n"
EVIL_CONF = {
    "model/evil.yaml": EXEC,
    "experiment/evil_callback.yaml": (
        "# @package _global_\nhydra:\n  callbacks:\n    evil:\n      "
        + EXEC.replace("\n", "\n      ")
    ),
    "experiment/evil_logging.yaml": (
        "# @package _global_\nhydra:\n  hydra_logging:\n    handlers:\n      evil:\n"
        "        (): shutil.copy\n        src: src.txt\n        dst: marker\n"
    ),
    "experiment/trusts_torch.yaml": "# @package _global_\nallowed_targets: [torch]\n",
}


def write_evil_conf(root: Path) -> None:
    for name, text in EVIL_CONF.items():
        (root / "evil_conf" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "evil_conf" / name).write_text(text)


@pytest.mark.parametrize(("overrides", "expected"), REFUSED, ids=lambda v: str(v))
def test_a_refused_target_runs_nothing_and_makes_no_run_dir(cli, tmp_path, overrides, expected):
    (tmp_path / "src.txt").write_text("copied\n")
    write_evil_conf(tmp_path)
    result = cli(*overrides, *TINY_RUN, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]  # one line
    assert result.stderr.startswith("error: ") and expected in result.stderr, result.stderr
    assert not (tmp_path / "marker").exists()
    # No outputs/, multirun/, mlflow.db or log file.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil_conf", "src.txt"]


def files_holding(root: Path, secrets: list[str]) -> list[Path]:
    return sorted(
        path.relative_to(root)
        for path in root.rglob("*")
        if path.is_file() and any(secret.encode() in path.read_bytes() for secret in secrets)
    )


URL_PASSWORD = "PLANTED-PASSWORD-321"  # the password of a data mirror's URL
ENV_URL_PASSWORD = "PLANTED-PASSWORD-654"  # inside $MLFLOW_TRACKING_URI
FILE_URL_PASSWORD = "PLANTED-PASSWORD-987"  # in an experiment file


def test_a_multirun_writes_no_secret_either(cli, tmp_path):
    experiment = tmp_path / "conf" / "experiment" / "mirror.yaml"
    experiment.parent.mkdir(parents=True)
    experiment.write_text(
        "# @package _global_\ndata:\n"
        f"  file_mirror: https://amy:{FILE_URL_PASSWORD}@example.org/x\n"
    )
    result = cli(
        "-m",
        "-cd",
        "conf",
        "experiment=mirror",
        f"+data.api_token={TOKEN}",
        f"+data.mirror=https://bob:{URL_PASSWORD}@example.com/data",
        "optimizer.lr=0.1,0.05",
        *TINY_RUN,
        cwd=tmp_path,
        env={
            "WANDB_API_KEY": WANDB_KEY,
            "MLFLOW_TRACKING_URI": f"https://u:{ENV_URL_PASSWORD}@mlflow.example.com",
        },
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [sweep_dir] = tmp_path.glob("multirun/*/*")
    assert (sweep_dir / "multirun.yaml").exists() and (sweep_dir / "0" / "summary.json").exists()
    assert OmegaConf.load(sweep_dir / "multirun.yaml").data.api_token == REDACTED
    job_config = OmegaConf.load(sweep_dir / "1" / "config.yaml")
    assert job_config.data.mirror == f"https://bob:{REDACTED}@example.com/data"
    assert job_config.data.file_mirror == f"https://amy:{REDACTED}@example.org/x"
    secrets = [TOKEN, WANDB_KEY, URL_PASSWORD, ENV_URL_PASSWORD, FILE_URL_PASSWORD]
    for secret in secrets:
        assert secret not in result.stdout + result.stderr
    assert files_holding(tmp_path, secrets) == [Path("conf/experiment/mirror.yaml")]  # the source
