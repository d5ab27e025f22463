import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Builds and eval mirrors go to a cache of this session, removed when it ends (a model build is
# ~600 MB); a QUANTMLA_CACHE set by the caller is used as it is and kept.
_SESSION_CACHE = None if "QUANTMLA_CACHE" in os.environ else tempfile.mkdtemp(prefix="quantmla-cache-")
if _SESSION_CACHE:
    os.environ["QUANTMLA_CACHE"] = _SESSION_CACHE


def pytest_unconfigure(config):
    if _SESSION_CACHE:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


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
