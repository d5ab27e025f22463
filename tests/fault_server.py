"""Imported once by the fork server of tests/fault_tools.py: the harness, and the packaged text it
parses, ready in every process forked from it."""

import analysis.callbacks  # noqa: F401
import analysis.table  # noqa: F401
import baselines  # noqa: F401
import quantmla.evals.ppl  # noqa: F401
import quantmla.methods.quantmla  # noqa: F401
import quantmla.models.tiny  # noqa: F401
import quantmla.run  # noqa: F401
from quantmla import data

data.wiki_articles()
data.news_split("test")

from quantmla.run import validate_argv  # noqa: E402

validate_argv(["model=tiny", "logger=none"])  # Hydra's plugins and config sources found once
