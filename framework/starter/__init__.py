"""`framework-new <folder>`: a user project of one's own, outside the clone (create.py), written
from the runnable skeleton in skeleton/ (a package with a model, a dataset and a task, their
config options, an experiment preset and a test that trains 2 steps on 2 ranks)."""
