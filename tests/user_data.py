"""A user's data option with settings of its own (an API token, a mirror URL, a note) besides
those of the data it loads: where the secret-scrubbing tests plant their secrets, as a
researcher's loader that authenticates to a service would receive them."""

from __future__ import annotations

from framework.components.data import Splits, synthetic


def synthetic_with_settings(
    train_size: int,
    val_size: int,
    in_channels: int,
    image_size: int,
    num_classes: int,
    seed: int,
    **settings: object,
) -> Splits:
    """The synthetic data set, whatever `settings` say (a real loader would use its token)."""
    return synthetic(train_size, val_size, in_channels, image_size, num_classes, seed)
