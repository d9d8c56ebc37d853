"""A finished run trained further: its learning-rate schedule does not jump back up (the added
steps continue at its final rate, and a line says so), and a run already complete names the
limit that ended it."""

from __future__ import annotations

import pytest

from tests.conftest import read_metrics

pytestmark = pytest.mark.slow
TINY = ("launcher.nproc_per_node=1", "model.width=4", "trainer.log_every=1")


def lrs(run) -> dict[int, float]:
    return {event["step"]: event["lr"] for event in read_metrics(run) if "lr" in event}


def test_a_finished_cosine_run_given_more_steps_continues_at_its_final_rate(cli, tmp_path):
    run = tmp_path / "run"
    args = (*TINY, "scheduler=cosine", "scheduler.min_lr_ratio=0.01", f"hydra.run.dir={run}")
    assert cli(*args, "trainer.max_steps=4", cwd=tmp_path).returncode == 0
    last = lrs(run)[4]  # the rate its last step ran at; the schedule ends at 0.01 x lr
    extended = cli(*args, "trainer.max_steps=8", cwd=tmp_path)
    assert extended.returncode == 0, extended.stderr[-3000:]
    rates = lrs(run)
    tail = [rates[step] for step in range(5, 9)]
    assert tail == [pytest.approx(0.1 * 0.01, rel=1e-12)] * 4 and tail[0] < last
    assert "the learning-rate schedule ended at step 4: the 4 added steps continue" in (
        extended.stderr + extended.stdout
    )


def test_a_run_already_complete_names_the_limit_that_ended_it(cli, tmp_path):
    run = tmp_path / "run"
    args = (*TINY, "data.batch_size=256", "trainer.max_epochs=1", f"hydra.run.dir={run}")
    assert cli(*args, "trainer.max_steps=null", cwd=tmp_path).returncode == 0
    again = cli(*args, "trainer.max_steps=100", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    said = again.stderr + again.stdout
    assert "is complete at step 5 (the planned 5 steps, set by trainer.max_epochs=1 (1 x 5 " in said
    assert "raise trainer.max_epochs to train further" in said
