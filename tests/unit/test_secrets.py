"""Secrets by value (framework/core/secrets.py): which values are secret, and the choke points
that scrub them: log records, the console, the errors a process prints, the written config."""

from __future__ import annotations

import logging
import logging.config
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from framework.app.command_line import hide_secrets
from framework.app.hydra_records import redact_multirun_master
from framework.config import CONF_DIR
from framework.config.redaction import redacted_container
from framework.config.registry import register_configs
from framework.core.exits import ConfigError, outcome_of
from framework.core.secrets import (
    ENV_READ,
    REDACTED,
    install_log_scrubbing,
    install_traceback_scrubbing,
    is_secret_name,
    known_secrets,
    scrub,
    scrubbed_console,
    url_passwords,
)
from tests.conftest import make_cfg

SECRET = "PLANTED-SECRET-321"


@pytest.fixture(autouse=True)
def no_names_read(monkeypatch):
    """Each test starts with no variable read through ${oc.env:...} yet."""
    monkeypatch.delenv(ENV_READ, raising=False)


@pytest.mark.parametrize("name", ["PGPASSWORD", "DATA_ROOT", "MY_SERVICE"])
def test_a_value_read_through_oc_env_is_a_secret_whatever_its_name(monkeypatch, name):
    secret = f"{SECRET}-{name}"
    monkeypatch.setenv(name, secret)
    assert secret not in known_secrets()  # not read yet: the environment is not all secret
    cfg = make_cfg(f"+data.note=${{oc.env:{name}}}", f"+data.where=at-${{oc.env:{name}}}")
    record = redacted_container(cfg)
    assert record["data"]["note"] == REDACTED and record["data"]["where"] == f"at-{REDACTED}"
    assert secret in known_secrets()


def test_harmless_variables_read_through_oc_env_stay_readable(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("SLURM_NTASKS", "123456")
    cfg = make_cfg("+data.home=${oc.env:HOME}", "+data.tasks=${oc.env:SLURM_NTASKS}")
    record = redacted_container(cfg)
    assert record["data"]["home"] == str(tmp_path) and record["data"]["tasks"] == "123456"


@pytest.mark.parametrize(
    "name", ["GITHUB_PAT", "DB_PASS", "db_pass", "AUTH_HEADER", "X_API_KEY", "per_user_token"]
)
def test_secret_looking_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize(
    "name", ["PATH", "passes", "pattern", "author", "num_passes", "task.chars_per_token"]
)
def test_names_that_only_contain_a_secret_word(name):
    assert not is_secret_name(name)


def test_secret_looking_variables_are_secrets_unread(monkeypatch):
    monkeypatch.setenv("GITHUB_PAT", "PLANTED-PAT-1")
    monkeypatch.setenv("DB_PASS", "PLANTED-PASS-2")
    assert {"PLANTED-PAT-1", "PLANTED-PASS-2"} <= known_secrets()
    assert not {value for value in known_secrets() if value.startswith("/")}  # PWD, HOME


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("https://bob:pa/ss-word@example.com/x", f"https://bob:{REDACTED}@example.com/x"),
        ("s3://k:a%2Fb%40cdef@bucket", f"s3://k:{REDACTED}@bucket"),
        ("https://ghp_0123456789@github.com/o/r", f"https://{REDACTED}@github.com/o/r"),
        ("ssh://git@github.com/o/r", "ssh://git@github.com/o/r"),  # a user name
        ("http://host:8080/path@scope/x", "http://host:8080/path@scope/x"),  # a port, a path
        ("https://example.com/a:b@c", "https://example.com/a:b@c"),
    ],
)
def test_a_urls_userinfo_is_scrubbed_whatever_its_characters(text, expected):
    assert scrub(text, set()) == expected


def test_a_url_password_is_a_secret_as_written_and_decoded():
    assert url_passwords("s3://k:a%2Fb%40cdef@bucket") == {"a%2Fb%40cdef", "a/b@cdef"}
    assert scrub("error: bad password a/b@cdef", url_passwords("s3://k:a%2Fb%40cdef@b")) == (
        f"error: bad password {REDACTED}"
    )


def test_a_swept_secret_moves_to_the_environment_value_by_value():
    environ: dict[str, str] = {}
    hidden = hide_secrets([f"+data.api_token={SECRET},other-secret"], environ)
    assert hidden == [
        "+data.api_token=${oc.env:FRAMEWORK_SECRET_DATA_API_TOKEN_0},"
        "${oc.env:FRAMEWORK_SECRET_DATA_API_TOKEN_1}",
    ]
    assert environ == {
        "FRAMEWORK_SECRET_DATA_API_TOKEN_0": SECRET,
        "FRAMEWORK_SECRET_DATA_API_TOKEN_1": "other-secret",
    }


def test_every_log_record_is_scrubbed_even_after_logging_is_configured_again(monkeypatch, capsys):
    """Hydra configures logging (its own, then the job's) after we do: the scrubbing is in the
    records, not in a handler it replaces."""
    monkeypatch.setenv("PGPASSWORD", SECRET)
    assert make_cfg("+data.note=${oc.env:PGPASSWORD}").data.note == SECRET  # read: a secret
    install_log_scrubbing()
    logging.config.dictConfig(
        {
            "version": 1,
            "disable_existing_loggers": False,  # (the other tests' loggers)
            "handlers": {"out": {"class": "logging.StreamHandler", "stream": "ext://sys.stdout"}},
            "loggers": {"some.library": {"handlers": ["out"], "level": "INFO"}},
        }
    )
    log = logging.getLogger("some.library")
    try:
        log.info("Launching with %s", SECRET)
        try:
            raise RuntimeError(f"failed at https://u:{SECRET}@host")
        except RuntimeError:
            log.exception("it broke")
    finally:
        for handler in list(log.handlers):
            log.removeHandler(handler)
    out = capsys.readouterr().out
    assert SECRET not in out and f"Launching with {REDACTED}" in out
    assert f"https://u:{REDACTED}@host" in out  # in the traceback too


def test_the_console_is_scrubbed_while_train_runs(monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    with scrubbed_console():
        print(f"token {SECRET}")
        print(f"token {SECRET}", file=sys.stderr)
    print(f"after {SECRET}")  # the streams are the process's own again
    captured = capsys.readouterr()
    assert captured.out == f"token {REDACTED}\nafter {SECRET}\n"
    assert captured.err == f"token {REDACTED}\n"


def test_a_ranks_error_and_traceback_are_scrubbed(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    rejected = outcome_of(ConfigError(f"data.root={SECRET} does not exist"))
    assert rejected.printed == f"error: data.root={REDACTED} does not exist"
    assert rejected.reason == f"data.root={REDACTED} does not exist"
    try:
        raise RuntimeError(f"bug with {SECRET}")
    except RuntimeError as error:
        failed = outcome_of(error)
    assert failed.printed and "Traceback" in failed.printed and SECRET not in failed.printed
    assert failed.reason == f"RuntimeError: bug with {REDACTED}"


def test_a_sweep_parameter_of_a_secret_looking_key_is_redacted_in_multirun_yaml():
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", return_hydra_config=True)
    with open_dict(cfg.hydra.sweeper):
        cfg.hydra.sweeper.params = {
            "+data.api_token": f"{SECRET},x1234567",
            "optimizer.lr": "0.1,1",
        }
    redact_multirun_master(cfg)  # (the sweeper holds its own copy by now)
    assert dict(cfg.hydra.sweeper.params) == {"+data.api_token": REDACTED, "optimizer.lr": "0.1,1"}


def test_an_uncaught_exceptions_traceback_is_scrubbed(monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    install_traceback_scrubbing()
    try:
        raise RuntimeError(f"HYDRA_FULL_ERROR=1 shows {SECRET}")
    except RuntimeError as error:
        sys.excepthook(type(error), error, error.__traceback__)
    err = capsys.readouterr().err
    assert "Traceback" in err and f"shows {REDACTED}" in err and SECRET not in err


def test_a_number_read_from_the_environment_is_redacted_in_the_record(monkeypatch):
    monkeypatch.setenv("PIN_CODE", "90210417")
    record = redacted_container(make_cfg("trainer.seed=${oc.env:PIN_CODE}"))
    assert record["trainer"]["seed"] == REDACTED


def test_a_changed_environment_is_read_again(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "PLANTED-FIRST-1")
    assert "PLANTED-FIRST-1" in known_secrets()
    monkeypatch.setenv("HF_TOKEN", "PLANTED-SECOND-2")  # the same names, another value
    assert "PLANTED-SECOND-2" in known_secrets() and "PLANTED-FIRST-1" not in known_secrets()
