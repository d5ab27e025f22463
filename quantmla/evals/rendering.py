"""lm-eval's ``ConfigurableTask`` with its prompt renders kept per document.

lm-eval renders a task's Jinja templates (``doc_to_text``, ``doc_to_target``, ``doc_to_choice``)
by compiling the template anew on every call (``lm_eval.utils.apply_template``), and a k-shot
context renders its k examples again for every test document. MMLU 5-shot draws its examples
from the same 5 development questions per subject, so building its 14,042 contexts compiled a
template about 98,000 times: some 3 minutes of host time in every run. This task keeps each
render, keyed by the template and the document's content, so an example already rendered is
not compiled again. A render is a pure function of the two, so nothing else changes: every
method is lm-eval's own, called once per distinct (template, document).

The offline mirrors (:mod:`quantmla.evals.mirrors`) build their tasks with this class.
"""

from __future__ import annotations

import json

from lm_eval.api.task import ConfigurableTask


class RenderedTask(ConfigurableTask):
    def __init__(self, data_dir=None, cache_dir=None, download_mode=None, config: dict | None = None):
        # lm-eval hands a class-built task its whole YAML, the ``class`` key that named it included
        config = {k: v for k, v in (config or {}).items() if k != "class"}
        self._renders: dict = {}  # before lm-eval's __init__, which renders a document too
        super().__init__(data_dir=data_dir, cache_dir=cache_dir, download_mode=download_mode, config=config)

    def doc_to_text(self, doc, doc_to_text=None):
        return self._kept("text", super().doc_to_text, doc, doc_to_text)

    def doc_to_target(self, doc, doc_to_target=None):
        return self._kept("target", super().doc_to_target, doc, doc_to_target)

    def doc_to_choice(self, doc, doc_to_choice=None):
        return self._kept("choice", super().doc_to_choice, doc, doc_to_choice)

    def _kept(self, kind: str, render, doc, template):
        key = self._key(kind, doc, template)
        if key is None:
            return render(doc, template)
        out = self._renders.get(key)
        if out is None:
            out = self._renders[key] = render(doc, template)
        return list(out) if isinstance(out, list) else out  # a caller may change the list it gets

    def _key(self, kind: str, doc, template):
        """(kind, template, document as JSON), or None where no key can be made safely: a prompt
        source, a template that is not a string, or a document that is not plain data."""
        if self.prompt is not None or not (template is None or isinstance(template, str)):
            return None
        try:
            return kind, template, json.dumps(doc, sort_keys=True, ensure_ascii=False)
        except (TypeError, ValueError):
            return None
