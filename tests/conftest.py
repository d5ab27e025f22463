import os
import shutil
import signal
import tempfile

# Ctrl-C raises KeyboardInterrupt, as from a terminal, also in a test run started in the background
# of a shell without job control: that hands SIGINT over ignored, Python then leaves it ignored, and
# so would every process the tests start (a handler, unlike an ignored signal, is reset by exec)
signal.signal(signal.SIGINT, signal.default_int_handler)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Builds and eval mirrors go to a cache of this session, removed when it ends (a model build is
# ~600 MB); a QUANTMLA_CACHE set by the caller is used as it is and kept. The folder is named
# after the session's process, so a later session removes it if that process was killed.
CACHE_PREFIX = "quantmla-cache-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_caches(root: str) -> list[str]:
    """Remove session caches under ``root`` whose process is gone; returns their names."""
    gone = []
    for name in os.listdir(root):
        pid = name[len(CACHE_PREFIX) :].split("-")[0] if name.startswith(CACHE_PREFIX) else ""
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            gone.append(name)
    return gone


_SESSION_CACHE = None
if "QUANTMLA_CACHE" not in os.environ:
    remove_stale_caches(tempfile.gettempdir())
    _SESSION_CACHE = tempfile.mkdtemp(prefix=f"{CACHE_PREFIX}{os.getpid()}-")
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


def pytest_collection_modifyitems(config, items):
    if not _has_cuda():
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture
def tiny():
    """A fresh seeded tiny DeepseekV2 model and its tokenizer."""
    from quantmla.models.tiny import build

    return build()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# QUANTMLA_TEST_LOG=FILE: each test's outcome and duration, and each failure's report, appended as
# it happens, so a run cut short (a job's time limit, a lost machine) keeps what it learned.
_TEST_LOG = os.environ.get("QUANTMLA_TEST_LOG")


def pytest_runtest_logreport(report):
    if not _TEST_LOG or (report.when != "call" and report.passed):
        return
    if getattr(report, "node", None) is not None:  # under xdist: the worker has written it already
        return
    with open(_TEST_LOG, "a") as f:
        f.write(f"{report.outcome.upper()} {report.when} {report.duration:.1f}s {report.nodeid}\n")
        if report.failed:
            f.write(str(report.longrepr)[-6000:] + "\n")
