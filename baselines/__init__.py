"""Baselines adapted to MLA (spec §6), registered in :mod:`quantmla.methods`."""

from baselines import quarot, rtn, smoothquant  # noqa: F401
