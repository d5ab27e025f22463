"""Baselines adapted to MLA (the paper's App. D.2), registered in :mod:`quantmla.methods`."""

from baselines import quarot, rtn, smoothquant  # noqa: F401
