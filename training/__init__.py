"""Benchmark baselines and training data, run from a checkout of the repository (not
installed with ``diffspec``): :mod:`training.sharegpt` (distillation answers),
:mod:`training.eagle3` (the EAGLE-3 baseline drafter) and :mod:`training.gpu_run` (both
drafters on one GPU in one command). Run them as ``python -m training.<module>``."""
