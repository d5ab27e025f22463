import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def tiny():
    """A fresh seeded tiny DeepseekV2 model and its tokenizer."""
    from quantmla.models.tiny import build

    return build()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
