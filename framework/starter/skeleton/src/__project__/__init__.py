"""A model, a dataset and a task, configured by conf/ beside this package."""
