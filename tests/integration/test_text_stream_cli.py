"""data=text_stream from the command line: a short run of the char GPT on the streamed standard
library, and data.files refused outside the folders it may read (docs/data.md)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import read_metrics

SMALL_GPT = ("model.layers=1", "model.width=32", "task.sample_tokens=20", "trainer.log_every=2")


@pytest.mark.parametrize("files", ["/etc/passwd", "../*/.ssh/*", "texts/*/../../../*"])
def test_data_files_outside_the_project_and_the_data_dirs_is_one_line_and_no_run_dir(
    cli, tmp_path, files
):
    (tmp_path / "texts").mkdir()
    result = cli("experiment=char_gpt", "data=text_stream", f"data.files={files}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"error: data.files={files} lies outside the working directory and the folders "
        "$FRAMEWORK_DATA_DIRS names: move the files under the project, or add their folder to "
        "$FRAMEWORK_DATA_DIRS (data.files=null streams the standard library's source)"
    ]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["texts"]  # no run dir


def test_char_gpt_trains_on_the_streamed_standard_library_from_the_command_line(cli, tmp_path):
    """The documented command, shortened: the default corpus, 2 ranks, 2 workers each."""
    run_dir = tmp_path / "run"
    result = cli(
        "experiment=char_gpt",
        "data=text_stream",
        "data.num_workers=2",
        "trainer.max_steps=4",
        *SMALL_GPT,
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [e["train/loss"] for e in read_metrics(run_dir) if "train/loss" in e]
    assert len(losses) == 2 and losses[-1] < losses[0]
    assert [e["step"] for e in read_metrics(run_dir) if "val/loss" in e] == [4]
    assert "the model's continuation (20 tokens" in (run_dir / "samples.txt").read_text()


def test_a_data_files_name_longer_than_a_file_system_takes_is_one_line(cli, tmp_path):
    """data.files is a path-named key: its text is judged as a path's (framework/app/
    job_values.py), before anything looks for the files."""
    files = f"texts/{'x' * 300}/*.txt"
    result = cli("experiment=char_gpt", "data=text_stream", f"data.files={files}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(result.stderr.strip().splitlines()) == 1
    assert "is longer than the 255 bytes allowed" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_persistent_workers_on_a_stream_is_one_line_and_no_run_dir(cli, tmp_path):
    """Persistent workers keep the copy of the stream made at the first epoch: they would read
    epoch 0's order again, and a resumed run's first epoch from its start position."""
    result = cli(
        "experiment=char_gpt",
        "data=text_stream",
        "data.persistent_workers=true",
        "data.num_workers=2",
        "trainer.max_steps=2",
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        "error: data.persistent_workers=true keeps a stream's workers from seeing each epoch's "
        "position: set data.persistent_workers=false"
    ]
    assert list(tmp_path.iterdir()) == []


JSONL_MISTAKES = {  # a .jsonl file's second line -> what the one line says
    '{"text": "cut"': "texts/b.jsonl line 2 is not JSON (Expecting ',' delimiter at column",
    '{"title": "a"}': "texts/b.jsonl line 2 has no field 'text' (data.text_field=text)",
    '{"text": 7}': "texts/b.jsonl line 2: its field 'text' (data.text_field=text) is 7, not a",
}
PARQUET_MISTAKES = {  # a .parquet file's columns -> what the one line says
    "title": "texts/b.parquet has no column 'text' (data.text_field=text): its columns are title",
    "text": "texts/b.parquet: its column 'text' (data.text_field=text) holds int64, not strings",
}


@pytest.mark.parametrize("mistake", [*JSONL_MISTAKES, *PARQUET_MISTAKES])
def test_a_jsonl_or_parquet_file_without_its_text_is_one_line_naming_it_and_no_run_dir(
    cli, tmp_path, mistake
):
    """Found when the files are read through for their index, by the trial before any rank
    starts: the file, the line or column, and data.text_field."""
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("some text to stream " * 20)
    if mistake in JSONL_MISTAKES:
        (tmp_path / "texts" / "b.jsonl").write_text(f'{{"text": "fine"}}\n{mistake}\n')
        said = JSONL_MISTAKES[mistake]
    else:
        pq.write_table(pa.table({mistake: [1, 2, 3]}), tmp_path / "texts" / "b.parquet")
        said = PARQUET_MISTAKES[mistake]
    result = cli(
        "experiment=char_gpt",
        "data=text_stream",
        "data.files=texts/*",
        "data.val_files=1",
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: data.files: {said}"), line
    assert sorted(path.name for path in tmp_path.iterdir()) == ["texts"]  # no run dir


def test_a_stream_whose_files_changed_since_the_checkpoint_is_not_resumed(cli, tmp_path):
    """A stream's position counts windows of its files: more text in them would shift every
    window after the change (some read twice, some never), so the run refuses to go on."""
    texts = tmp_path / "texts"
    texts.mkdir()
    for name in ("a", "b", "c"):
        (texts / f"{name}.txt").write_text(f"{name} says hello to the stream. " * 200)
    run_dir = tmp_path / "run"
    run = ("experiment=char_gpt", "data=text_stream", "data.files=texts/*.txt", "data.val_files=1")
    run += (*SMALL_GPT, "launcher.nproc_per_node=1", f"hydra.run.dir={run_dir}")
    assert cli(*run, "trainer.max_steps=4", cwd=tmp_path).returncode == 0
    last = (run_dir / "checkpoints" / "last.pt").read_bytes()
    with (texts / "b.txt").open("a") as file:
        file.write("more text " * 50)
    longer = cli(*run, "trainer.max_steps=6", cwd=tmp_path)
    assert longer.returncode == 2, longer.stderr[-3000:]
    assert "Traceback" not in longer.stderr
    assert longer.stderr.strip().splitlines()[-1:] == [
        "error: the training data changed since the checkpoint was saved (its sizes): put it "
        "back to resume exactly, or start a new run in another dir"
    ]
    assert (run_dir / "checkpoints" / "last.pt").read_bytes() == last
