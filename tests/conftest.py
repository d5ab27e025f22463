import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# Without CUDA the Triton kernels run in the interpreter; the switch must be set before any
# test imports quantmla.kernels (kernels read it when they are decorated).
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
