"""Tasks as pure functions: their metrics against reference implementations, the per-item
normalisation that keeps token-weighted losses exact, and the checks that refuse a task that
does not fit the data or the model (one message naming the task and the fix)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch import nn

from framework.components.data import PadSequences, load_splits, to_device
from framework.components.models import GPT, VAE, FeedForward, SmallCNN
from framework.components.tasks import (
    Autoencoder,
    Classification,
    LanguageModel,
    Regression,
    Task,
    TaskLoss,
    first_batch,
    require_logits,
)
from framework.components.tasks.base import pack_states, unpack_states
from framework.config.registry import option_values
from framework.config.validation import validate
from framework.core.exits import ConfigError, is_out_of_memory
from framework.rank.build import OneForwardPerInput, check_task
from tests.conftest import make_cfg


def totals_over(task: Task, model: nn.Module, batches: list) -> dict[str, float]:
    """What the runner does: add up each batch's sum states (here in one process)."""
    totals = dict.fromkeys(task.states, 0.0)
    for batch in batches:
        for name, value in task.evaluate(model, batch).items():
            totals[name] += float(value)
    return task.compute(totals)


def test_classification_metrics_are_the_mean_cross_entropy_and_the_accuracy():
    torch.manual_seed(0)
    model = SmallCNN(in_channels=1, num_classes=10, width=4).eval()
    images, labels = torch.randn(37, 1, 8, 8), torch.randint(0, 10, (37,))
    batches = [(images[:20], labels[:20]), (images[20:], labels[20:])]
    with torch.no_grad():
        metrics = totals_over(
            Classification(**option_values("task", "classification")), model, batches
        )
        logits = model(images)
    assert metrics["loss"] == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-6)
    assert metrics["accuracy"] == pytest.approx((logits.argmax(1) == labels).float().mean().item())


def test_regression_r2_and_mae_match_scikit_learn():
    # Imported here: scikit-learn costs each pytest worker about 2 s of collection otherwise.
    from sklearn.metrics import mean_absolute_error, r2_score

    torch.manual_seed(0)
    model = FeedForward(in_features=3, out_features=1, hidden_sizes=[8], dropout=0.0).eval()
    features, targets = torch.randn(51, 3), torch.randn(51)
    batches = [(features[:17], targets[:17]), (features[17:], targets[17:])]
    with torch.no_grad():
        metrics = totals_over(Regression(), model, batches)
        predictions = model(features).squeeze(-1).double()
    targets = targets.double()  # scikit-learn computes in its inputs' precision
    assert metrics["r2"] == pytest.approx(r2_score(targets, predictions), rel=1e-6)
    assert metrics["mae"] == pytest.approx(mean_absolute_error(targets, predictions), rel=1e-6)
    assert metrics["mse"] == pytest.approx(F.mse_loss(predictions, targets).item(), rel=1e-9)


def ragged_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two micro-batches of next-token pairs holding very different numbers of tokens."""
    generator = torch.Generator().manual_seed(0)
    lengths = [[3, 2], [30, 25]]
    pad = PadSequences()
    batches = []
    for group in lengths:
        samples = []
        for length in group:
            tokens = torch.randint(0, 16, (length + 1,), generator=generator)
            samples.append((tokens[:-1], tokens[1:]))
        batches.append(pad(samples))
    return batches


def test_language_model_perplexity_and_bits_per_char_follow_the_per_token_loss():
    torch.manual_seed(0)
    model = GPT(
        vocab_size=16, block_size=32, layers=1, heads=2, width=16, dropout=0.0, activation="gelu"
    ).eval()
    batches = ragged_batches()
    task = LanguageModel(**option_values("task", "language_model"))
    with torch.no_grad():
        metrics = totals_over(task, model, batches)
        per_token = torch.cat(
            [
                F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none")[
                    y.flatten() >= 0
                ]
                for x, y in batches
            ]
        )
    assert metrics["loss"] == pytest.approx(per_token.mean().item(), rel=1e-6)
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["loss"]), rel=1e-9)
    assert metrics["bits_per_char"] == pytest.approx(metrics["loss"] / math.log(2), rel=1e-9)


def test_normalising_by_the_tokens_of_the_whole_step_gives_one_big_batchs_gradient():
    """What the runner does under accumulation (and across ranks): each micro-batch's summed
    loss over the step's token count. The naive mean of per-micro-batch means differs."""
    torch.manual_seed(0)
    model = GPT(
        vocab_size=16, block_size=32, layers=1, heads=2, width=16, dropout=0.0, activation="gelu"
    )
    task = LanguageModel(**option_values("task", "language_model"))
    small, large = ragged_batches()
    step_tokens = sum(int(task.count(batch)) for batch in (small, large))

    def gradient(losses: list[torch.Tensor]) -> torch.Tensor:
        model.zero_grad()
        sum(losses).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    exact = gradient([task.loss(model, b).total / step_tokens for b in (small, large)])
    one_batch = PadSequences()([*zip(*small, strict=True), *zip(*large, strict=True)])
    reference = gradient([task.loss(model, one_batch).total / int(task.count(one_batch))])
    torch.testing.assert_close(exact, reference, rtol=1e-5, atol=1e-7)
    naive = gradient([task.loss(model, b).total / int(task.count(b)) / 2 for b in (small, large)])
    assert (naive - reference).norm() > 0.1 * reference.norm()  # 5 tokens weighed like 55


def test_vae_elbo_is_minus_reconstruction_minus_kl_per_sample():
    torch.manual_seed(0)
    model = VAE(in_channels=1, image_size=8, latent_dim=4, hidden_size=16, sample=False).eval()
    images = torch.rand(9, 1, 8, 8)
    task = Autoencoder(**option_values("task", "autoencoder", vae=True, reconstruction="bce"))
    with torch.no_grad():
        metrics = totals_over(task, model, [(images[:4],), (images[4:],)])
        logits, mu, logvar = model(images)
    bce = F.binary_cross_entropy_with_logits(logits, images, reduction="sum").item() / 9
    kl = (-0.5 * (1 + logvar - mu**2 - logvar.exp()).sum()).item() / 9
    assert metrics["reconstruction"] == pytest.approx(bce, rel=1e-6)
    assert metrics["kl"] == pytest.approx(kl, rel=1e-5)
    assert metrics["elbo"] == pytest.approx(-(bce + kl), rel=1e-6)


# --- a task that does not fit is refused before the first step -----------------------------
class VectorLoss(Task):
    """A user's task whose loss forgot to sum."""

    name = "vector_loss"
    metrics, states = {"loss": "min"}, ("loss", "count")

    def count(self, batch):
        return batch[1].numel()

    def loss(self, model, batch):
        return TaskLoss.sum(F.cross_entropy(model(batch[0]), batch[1], reduction="none"))

    def evaluate(self, model, batch):
        return {"loss": self.loss(model, batch).total.sum(), "count": batch[1].numel()}

    def compute(self, totals):
        return {"loss": totals["loss"] / totals["count"]}


class TupleOfLogits(nn.Module):
    def forward(self, tokens):
        logits = torch.zeros(*tokens.shape, 5)
        return logits, logits


# Weights and inputs from a fixed seed, whatever ran before: the logits check reads the
# untrained model's outputs, and an unlucky draw puts all of a small batch's in [0, 1].
_rng_before = torch.random.get_rng_state()
torch.manual_seed(0)
images, labels = torch.randn(4, 1, 8, 8), torch.tensor([1, 2, 3, 4])
MISFITS = [
    (
        Classification(**option_values("task", "classification")),
        SmallCNN(1, 10, 4),
        (images, torch.rand(4)),
        ["task=classification", "not integer class labels", "task=regression"],
    ),
    (
        Classification(**option_values("task", "classification")),
        SmallCNN(1, 1, 4),
        (images, labels * 0),
        ["at least 2 class logits", "task=regression"],
    ),
    (
        Classification(**option_values("task", "classification")),
        SmallCNN(1, 3, 4),
        (images, labels),
        ["labels run from 1 to 4", "3 class logits", "data.num_classes"],
    ),
    # A layer of the model raising on the data's inputs: the model's settings, not the task.
    (
        Classification(**option_values("task", "classification")),
        FeedForward(in_features=64, out_features=10, hidden_sizes=[8], dropout=0.0),
        (images, labels),
        ["the model cannot take this data's inputs", "its Linear raised", "model.in_features"],
    ),
    (
        Regression(),
        SmallCNN(3, 1, 4),
        (images, torch.rand(4)),
        ["the model cannot take this data's inputs", "its Conv2d raised", "model.in_channels"],
    ),
    (
        Regression(),
        SmallCNN(1, 10, 4),
        (images, labels),
        ["task=regression", "not real numbers", "task=classification"],
    ),
    (
        Regression(),
        SmallCNN(1, 10, 4),
        (images, torch.rand(4)),
        ["returns [4, 10] for targets [4]", "task=classification"],
    ),
    (
        LanguageModel(**option_values("task", "language_model")),
        SmallCNN(1, 10, 4),
        (images, labels),
        ["task=language_model", "token ids", "data=text"],
    ),
    (
        Autoencoder(**option_values("task", "autoencoder", vae=True)),
        SmallCNN(1, 10, 4),
        (images, labels),
        ["task.vae=true", "(reconstruction, mu, logvar)", "model=vae"],
    ),
    (
        Autoencoder(**option_values("task", "autoencoder")),
        VAE(1, 8, 2, 8, sample=True),
        (images,),
        ["task.vae=true"],
    ),
    (
        Autoencoder(**option_values("task", "autoencoder", vae=True, reconstruction="bce")),
        VAE(1, 8, 2, 8, sample=True),
        (images,),
        ["inputs in [0, 1]", "data.normalize=false"],
    ),
    (VectorLoss(), SmallCNN(1, 10, 4), (images, labels), ["must be a scalar", "got shape [4]"]),
    # A model returning a tuple to a task that reads one tensor (a VAE of one's own).
    (
        Classification(**option_values("task", "classification")),
        VAE(1, 8, 2, 8, sample=False),
        (images, labels),
        ["task=classification reads one tensor of class logits", "returns (float32 [4, 1, 8, 8]"],
    ),
    (
        Regression(),
        VAE(1, 8, 2, 8, sample=False),
        (images, torch.rand(4)),
        ["task=regression reads one tensor of predictions", "task=autoencoder task.vae=true"],
    ),
    (
        LanguageModel(**option_values("task", "language_model")),
        TupleOfLogits(),
        (labels.view(2, 2), labels.view(2, 2)),
        ["task=language_model reads one tensor of logits", "returns (float32 [2, 2, 5]"],
    ),
]
torch.random.set_rng_state(_rng_before)


@pytest.mark.parametrize(
    ("task", "model", "batch", "expected"), MISFITS, ids=lambda v: type(v).__name__
)
def test_a_task_that_does_not_fit_the_data_or_the_model_is_one_clear_config_error(
    task, model, batch, expected
):
    with pytest.raises(ConfigError) as error, torch.no_grad():
        task.check(model.eval(), batch)
    message = str(error.value)
    assert "\n" not in message
    for text in expected:
        assert text in message, message


class Greedy(nn.Module):
    """A layer whose activation this machine cannot hold: its allocation fails for real."""

    def forward(self, inputs):
        return inputs + torch.empty(2**62, dtype=torch.uint8).sum()


@pytest.mark.parametrize(
    "task",
    [Classification(**option_values("task", "classification")), Regression()],
    ids=lambda v: type(v).__name__,
)
def test_memory_that_runs_out_on_the_first_batch_is_not_called_a_config_mistake(task):
    """An allocation that fails in a layer is the rank's memory (exit 5, with what to change),
    not a model that cannot take the data's inputs (exit 2)."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10), Greedy())
    with pytest.raises(RuntimeError) as error, torch.no_grad():
        task.check(model.eval(), (images, labels))
    assert not isinstance(error.value, ConfigError), error.value
    assert is_out_of_memory(error.value), error.value


def test_every_shipped_task_fits_its_preset():
    """The presets' own first batch passes the check they will meet at start-up."""
    for preset in ("digits_cnn", "diabetes_mlp", "digits_vae", "char_gpt"):
        cfg = make_cfg(f"experiment={preset}")
        task, model, splits = instantiate(cfg.task), instantiate(cfg.model), load_splits(cfg.data)
        with torch.no_grad():
            task.check(model.eval(), first_batch(splits.train, 4))


@pytest.mark.parametrize(
    ("objective", "allowed"),
    [
        ("val/acc", ["val/accuracy", "val/loss", "samples_per_s", "wall_s"]),
        ("val/accuracy", None),  # regression reports r2, mse, mae
    ],
)
def test_an_objective_the_task_does_not_report_names_the_metrics_it_does(objective, allowed):
    cfg = (
        make_cfg(f"objective={objective}")
        if allowed
        else make_cfg("experiment=diabetes_mlp", f"objective={objective}")
    )
    with pytest.raises(ConfigError) as error:
        validate(cfg)
    for name in allowed or ["val/r2", "val/mse", "val/mae"]:
        assert name in str(error.value)


def test_batches_of_any_nesting_move_to_the_device_and_only_images_go_channels_last():
    batch = {
        "image": torch.rand(2, 3, 4, 4),
        "mask": torch.ones(2, 4, 4, 1, dtype=torch.long),
        "pair": (torch.zeros(1), [torch.ones(2)]),
        "name": "x",
    }
    moved = to_device(batch, torch.device("cpu"), channels_last=True)
    assert moved["image"].is_contiguous(memory_format=torch.channels_last)
    assert moved["mask"].is_contiguous()  # 4-D but not floating point: not an image
    assert isinstance(moved["pair"], tuple) and isinstance(moved["pair"][1], list)
    assert moved["name"] == "x"


# --- the loss says whether it is a sum or a mean ---------------------------------------------
class MeanLoss(VectorLoss):
    """A user's task whose loss is a mean, passed where the interface wants a sum."""

    name = "mean_loss"

    def loss(self, model, batch):
        return TaskLoss.sum(F.cross_entropy(model(batch[0]), batch[1]))


class DeclaredMean(MeanLoss):
    """The same mean, said to be one: exact like the sum."""

    def loss(self, model, batch):
        return TaskLoss.mean(F.cross_entropy(model(batch[0]), batch[1]), self.count(batch))


def test_a_mean_passed_as_a_sum_is_refused_before_the_first_step():
    model = SmallCNN(1, 10, 4).eval()
    expected = "it is a mean, not a sum: return TaskLoss.mean"
    with pytest.raises(ConfigError, match=expected), torch.no_grad():
        MeanLoss().check(model, (images, labels))


def test_a_declared_mean_is_the_same_loss_as_the_sum():
    torch.manual_seed(0)
    model = SmallCNN(1, 10, 4).eval()
    with torch.no_grad():
        DeclaredMean().check(model, (images, labels))
        declared = DeclaredMean().loss(model, (images, labels)).total
        summed = F.cross_entropy(model(images), labels, reduction="sum")
    assert declared.item() == pytest.approx(summed.item(), rel=1e-6)


def test_a_task_loss_cannot_be_built_without_saying_which():
    with pytest.raises(TypeError, match=r"TaskLoss.sum\(total\) or TaskLoss.mean"):
        TaskLoss(torch.tensor(1.0))


# --- states of any shape, checked through compute before the first step ----------------------
class PerClass(VectorLoss):
    """Per-class counts: a vector state."""

    name = "per_class"
    metrics, states = {"worst_recall": "max"}, ("hits", "seen")

    def loss(self, model, batch):
        return TaskLoss.sum(F.cross_entropy(model(batch[0]), batch[1], reduction="sum"))

    def evaluate(self, model, batch):
        hits = model(batch[0]).argmax(1) == batch[1]
        return {
            "hits": torch.bincount(batch[1][hits], minlength=10),
            "seen": torch.bincount(batch[1], minlength=10),
        }

    def compute(self, totals):
        seen = totals["seen"]
        return {"worst_recall": (totals["hits"][seen > 0] / seen[seen > 0]).min().item()}


class BrokenCompute(PerClass):
    name = "broken_compute"

    def compute(self, totals):
        return {"worst_recall": float(totals["hits"])}  # a vector is not a float


class VectorMetric(PerClass):
    name = "vector_metric"

    def compute(self, totals):
        return {"worst_recall": totals["hits"] / totals["seen"].clamp(min=1)}


def test_vector_states_pack_into_one_vector_and_back():
    task = PerClass()
    model = SmallCNN(1, 10, 4).eval()
    with torch.no_grad():
        task.check(model, (images, labels))
        states = task.evaluate(model, (images, labels))
    assert task.state_shapes == {"hits": (10,), "seen": (10,)}
    flat = pack_states(task, states, task.state_shapes, torch.device("cpu"))
    assert flat.shape == (20,) and flat.dtype == torch.float64
    back = unpack_states(task, flat * 2, task.state_shapes)
    assert torch.equal(back["seen"], 2 * states["seen"].double())


@pytest.mark.parametrize(
    ("task", "expected"),
    [
        (BrokenCompute(), "compute() fails on one batch's states"),
        (VectorMetric(), "compute() returned a tensor of shape [10] for 'worst_recall'"),
    ],
)
def test_a_compute_that_evaluation_would_crash_on_is_refused_up_front(task, expected):
    with pytest.raises(ConfigError) as error, torch.no_grad():
        task.check(SmallCNN(1, 10, 4).eval(), (images, labels))
    assert expected in str(error.value) and "\n" not in str(error.value)


# --- samples that cannot be batched --------------------------------------------------------
@pytest.mark.parametrize(
    ("samples", "expected"),
    [
        (
            [{"inputs": torch.zeros(3), "label": 1}, {"inputs": torch.zeros(3)}],
            "only sample 0 has the key 'label'",
        ),
        (
            [{"inputs": torch.zeros(3), "label": 1}, {"inputs": torch.zeros(4), "label": 2}],
            "sample['inputs'] has shape [3] in sample 0, [4] in sample 1",
        ),
        (
            [(torch.zeros(2), {"mask": torch.ones(2)}), (torch.zeros(2), {"mask": torch.ones(5)})],
            "sample[1]['mask'] has shape [2] in sample 0, [5] in sample 1",
        ),
    ],
)
def test_samples_that_cannot_be_batched_are_one_line_naming_the_key(samples, expected):
    with pytest.raises(ConfigError) as error:
        first_batch(samples, 2)
    message = str(error.value)
    assert expected in message and "data.collate_fn" in message and "\n" not in message


class SoftmaxCNN(nn.Module):
    """A model that ends in softmax: probabilities where cross-entropy wants logits."""

    def __init__(self) -> None:
        super().__init__()
        self.body = SmallCNN(1, 10, 4)

    def forward(self, x):
        return self.body(x).softmax(dim=1)


def test_probabilities_fed_to_a_logits_loss_are_refused():
    softmax = r"a final softmax\?\), but cross-entropy takes logits"
    with pytest.raises(ConfigError, match=softmax), torch.no_grad():
        Classification(**option_values("task", "classification")).check(
            SoftmaxCNN().eval(), (images, labels)
        )
    with pytest.raises(ConfigError, match=r"a final sigmoid\?\), but bce takes logits"):
        require_logits("multilabel", torch.rand(8, 5), "bce")
    require_logits("multilabel", torch.randn(8, 5), "bce")  # logits pass


class OwnSummedLoss(DeclaredMean):
    """A user's own task that says nothing of logits (no `logits_loss` of its own)."""


class SaysNotLogits(OwnSummedLoss):
    logits_loss = None  # said: the outputs are not logits


def test_an_own_task_that_says_nothing_of_logits_is_warned_of_probabilities():
    """Cross-entropy (which applies softmax) on a model ending in softmax trains to worse
    numbers in silence: a task that never declared logits_loss is told, once, what to do."""
    with torch.no_grad():
        warning = OwnSummedLoss().undeclared_probabilities(SoftmaxCNN().eval(), (images, labels))
        assert warning is not None and "a final softmax?" in warning
        assert "drop that activation" in warning and "logits_loss = None" in warning
        raw = SmallCNN(1, 10, 4).eval()
        assert OwnSummedLoss().undeclared_probabilities(raw, (images, labels)) is None
        said = SaysNotLogits().undeclared_probabilities(SoftmaxCNN().eval(), (images, labels))
        assert said is None
        declared = Classification(**option_values("task", "classification"))
        assert declared.undeclared_probabilities(SoftmaxCNN().eval(), (images, labels)) is None


class SumAsMean(MeanLoss):
    """A sum, given to TaskLoss.mean as if it were a mean: the loss grows by the batch size."""

    def loss(self, model, batch):
        summed = F.cross_entropy(model(batch[0]), batch[1], reduction="sum")
        return TaskLoss.mean(summed, self.count(batch))


def test_a_sum_passed_as_a_mean_is_refused_before_the_first_step():
    model = SmallCNN(1, 10, 4).eval()
    expected = r"4 times the value .* TaskLoss.mean\(value, count\) is a sum, not a mean"
    with pytest.raises(ConfigError, match=expected), torch.no_grad():
        SumAsMean().check(model, (images, labels))


class OwnLogitsTask(VectorLoss):
    """A task of one's own that declares its loss takes logits, and calls nothing itself."""

    name = "own"
    logits_loss = "cross-entropy"

    def loss(self, model, batch):
        return TaskLoss.sum(F.cross_entropy(model(batch[0]), batch[1], reduction="sum"))


def test_a_task_that_declares_a_logits_loss_gets_the_logits_check():
    refused = pytest.raises(ConfigError, match=r"task=own: .*cross-entropy takes logits")
    with refused, torch.no_grad():
        OwnLogitsTask().check(SoftmaxCNN().eval(), (images, labels))
    with torch.no_grad():
        OwnLogitsTask().check(SmallCNN(1, 10, 4).eval(), (images, labels))  # logits pass


class SigmoidAutoencoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.Unflatten(1, (1, 8, 8)))

    def forward(self, x):
        return self.body(x).sigmoid()


class SigmoidVAE(VAE):
    def forward(self, x):
        reconstruction, mu, logvar = super().forward(x)
        return reconstruction.sigmoid(), mu, logvar


@pytest.mark.parametrize("vae", [False, True])
def test_autoencoder_bce_on_a_model_ending_in_sigmoid_is_refused(vae):
    pixels = torch.rand(8, 1, 8, 8)
    values = {**option_values("task", "autoencoder"), "reconstruction": "bce", "vae": vae}
    shape = {"in_channels": 1, "image_size": 8}
    model = SigmoidVAE(**option_values("model", "vae", **shape)) if vae else SigmoidAutoencoder()
    model = model.eval()
    refused = pytest.raises(ConfigError, match=r"a final sigmoid\?\), but task.reconstruction=bce")
    with refused, torch.no_grad():
        Autoencoder(**values).check(model, pixels)
    with torch.no_grad():  # mse on the same model is what it is meant for
        Autoencoder(**{**values, "reconstruction": "mse"}).check(model, pixels)


# --- evaluation states are added up in float64 ------------------------------------------------
class Scaled(nn.Module):
    def forward(self, x):
        return x * 0.3


@pytest.mark.parametrize(
    ("task", "model", "data"),
    [
        (
            Classification(**option_values("task", "classification")),
            nn.Identity(),  # the inputs are the logits: each item's loss, whatever its batch
            lambda g: (
                torch.randn(3000, 10, generator=g) * 4,
                torch.randint(0, 10, (3000,), generator=g),
            ),
        ),
        (
            LanguageModel(**option_values("task", "language_model")),
            nn.Identity(),
            lambda g: (
                torch.randn(300, 10, 7, generator=g) * 4,
                torch.randint(0, 7, (300, 10), generator=g),
            ),
        ),
        (
            Autoencoder(**option_values("task", "autoencoder")),
            Scaled(),  # a reconstruction off by an item's own amount
            lambda g: (torch.rand(3000, 1, 2, 2, generator=g) * 100,),
        ),
    ],
)
def test_evaluation_states_do_not_depend_on_how_the_items_are_batched(task, model, data):
    """The same items in batches of 7 (as on one of several ranks) or in one batch: float32 sums
    of the batches round differently (about 1e-7 relative); float64 ones agree to 1e-12."""
    items = data(torch.Generator().manual_seed(0))
    one = task.evaluate(model, items)
    parts = [
        task.evaluate(model, tuple(t[i : i + 7] for t in items)) for i in range(0, len(items[0]), 7)
    ]
    for name, value in one.items():
        if value.is_floating_point():
            batched = sum(float(part[name]) for part in parts)  # float64, as pack_states adds
            assert batched == pytest.approx(float(value), rel=1e-12, abs=0), name


def test_the_pre_flight_check_runs_the_model_once_on_each_batch_it_looks_at():
    """The loss, evaluate() and the look at the logits all read the first batch; the sum check
    reads it repeated. One forward each (under a sharding strategy each gathers the whole
    model), and the outputs a task is given are its own to change."""
    model = SmallCNN(1, 10, 4)
    sizes = []
    model.register_forward_hook(lambda module, args, outputs: sizes.append(len(args[0])))
    task = Classification(**option_values("task", "classification"))
    assert check_task(task, model, (images, labels), torch.device("cpu")) is None
    assert sizes == [len(images), 2 * len(images)]

    once = OneForwardPerInput(model.eval())
    with torch.no_grad():
        first = once(images)
        first.zero_()
        again = once(images)
    assert sizes[2:] == [len(images)] and again.abs().sum() > 0
