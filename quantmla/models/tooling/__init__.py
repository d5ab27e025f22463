"""One-off tooling of the embedded model (``smollm2_mla``), run by hand and never by a run:
building its healing text (:mod:`.corpus`), healing the converted model by distillation
(:mod:`.heal`, ``scripts/heal-smollm2-mla`` on a GPU machine) and measuring it against SmolLM2
(:mod:`.measure`). What a run loads is in :mod:`quantmla.models`; docs/model.md has the commands.
"""
