"""curves.png as a user reads it: one panel per metric, and a lone evaluation labelled with its
value rather than left as one unlabelled dot."""

from __future__ import annotations

from framework.rank.plots import draw_curves, plot_run

EVENTS = [
    {"step": 10, "train/loss": 1.5, "train/accuracy": 0.5, "lr": 0.1},
    {"step": 20, "train/loss": 0.9, "train/accuracy": 0.7, "lr": 0.05},
    {"step": 20, "val/loss": 0.8123, "val/accuracy": 0.9712},  # eval_every=0: only at the end
]


def test_one_panel_per_metric_with_train_and_validation_together():
    figure = draw_curves(EVENTS, title="run")
    titles = [ax.get_title() for ax in figure.axes]
    assert titles == ["loss", "accuracy"]  # the losses first; lr is not a metric
    loss_axis = figure.axes[0]
    assert [line.get_label() for line in loss_axis.get_lines()] == [
        "train (mean over ranks)",
        "validation",
    ]
    assert list(loss_axis.get_lines()[0].get_xdata()) == [10, 20]


def test_a_single_evaluation_is_labelled_with_its_value():
    figure = draw_curves(EVENTS, title="run")
    labels = {ax.get_title(): [text.get_text() for text in ax.texts] for ax in figure.axes}
    assert labels == {"loss": ["validation 0.8123"], "accuracy": ["validation 0.9712"]}
    several = [*EVENTS, {"step": 30, "val/loss": 0.7, "val/accuracy": 0.98}]
    assert all(not ax.texts for ax in draw_curves(several, title="run").axes)  # lines say it


def test_no_metrics_no_picture(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "lr": 0.1}\n')
    assert draw_curves([{"step": 1, "lr": 0.1}], title="run") is None
    assert plot_run(tmp_path) is None and not (tmp_path / "curves.png").exists()
