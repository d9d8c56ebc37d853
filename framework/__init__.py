"""Hydra-configured DDP experiments."""
