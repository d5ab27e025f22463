"""Baselines adapted to MLA (spec §6), registered with :mod:`quantmla.registry`."""

from baselines import quarot, rtn, smoothquant  # noqa: F401
