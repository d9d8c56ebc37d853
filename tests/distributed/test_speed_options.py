"""trainer.channels_last and trainer.compile change speed, not what is learned."""

from __future__ import annotations

import pytest

from tests.conftest import TINY, make_cfg, train_losses, train_many

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_channels_last_and_compile_learn_what_the_eager_default_learns(tmp_path):
    base = (*TINY, "model=cnn", "model.width=8", "trainer.max_steps=6")
    variants = {"eager": (), "channels_last": ("trainer.channels_last=true",),
                "compile": ("trainer.compile=true",)}  # fmt: skip
    jobs = [(make_cfg(*base, *extra), tmp_path / name) for name, extra in variants.items()]
    summaries = dict(zip(variants, train_many(jobs), strict=True))
    eager = train_losses(tmp_path / "eager")
    for name in ("channels_last", "compile"):
        assert train_losses(tmp_path / name) == pytest.approx(eager, rel=1e-4), name
        assert summaries[name]["val/accuracy"] == pytest.approx(
            summaries["eager"]["val/accuracy"], abs=0.02)
