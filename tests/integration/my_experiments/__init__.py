"""A user's own experiment package, outside framework/ (README: bring your own task)."""
