"""A user's own experiment package, outside framework/ (docs/tasks.md)."""
