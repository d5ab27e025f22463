"""Baselines adapted to MLA (the paper's App. D.2), registered with :mod:`quantmla.registry`."""

from baselines import quarot, rtn, smoothquant  # noqa: F401
