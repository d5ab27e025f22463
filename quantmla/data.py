"""Real text from installed packages, with no download.

``wiki``: the 106 Wikipedia articles shipped in the ``gensim`` wheel's test data
(``enwiki-latest-pages-articles1...-shortened.bz2``, CC BY-SA), the nearest offline
stand-in for WikiText-2. Markup is stripped here. Articles are split deterministically:
every fifth article (by order in the dump) is held out as ``test`` (perplexity), the rest
is ``train`` (calibration). Nothing trained or calibrated by the project reads ``test``.

``news``: the 299 news articles of the Lee background corpus shipped in the same wheel
(``lee_background.cor``, one article per line), a web-text stand-in for C4 where the
sensitivity study wants a second corpus; split the same way (every fifth article is ``test``).

:class:`CalibrationData` draws the calibration banks (the paper's Table 7).
"""

from __future__ import annotations

import bz2
import html
import importlib.util
import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import torch

WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
NEWS_FILE = "lee_background.cor"
INSTALL_HINT = "pip install --no-deps gensim==4.4.0"


class DataUnavailable(RuntimeError):
    pass


def package_dir(name: str, hint: str) -> Path:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise DataUnavailable(f"package '{name}' is not installed; install it with: {hint}")
    return Path(next(iter(spec.submodule_search_locations)))


def wiki_path() -> Path:
    p = package_dir("gensim", INSTALL_HINT) / "test" / "test_data" / WIKI_FILE
    if not p.exists():
        raise DataUnavailable(f"{p} is missing from the installed gensim; reinstall with: {INSTALL_HINT}")
    return p


def _strip_nested(text: str, open_: str, close: str) -> str:
    pat = re.compile(re.escape(open_) + r"(?:(?!" + re.escape(open_) + r").)*?" + re.escape(close), re.S)
    while True:
        new = pat.sub("", text)
        if new == text:
            return text
        text = new


def clean_wikitext(text: str) -> str:
    """Plain prose from wikitext markup (headings kept as lines)."""
    text = html.unescape(text)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"<ref[^>]*/>", "", text)
    text = re.sub(r"<ref[^>]*>.*?</ref>", "", text, flags=re.S)
    text = re.sub(r"<(gallery|math|timeline|imagemap)[^>]*>.*?</\1>", "", text, flags=re.S)
    text = _strip_nested(text, "{{", "}}")
    text = _strip_nested(text, "{|", "|}")
    text = re.sub(r"\[\[(?:File|Image|Category|[a-z]{2,3}(?:-[a-z]+)?):(?:[^\[\]]|\[\[[^\]]*\]\])*\]\]", "", text)
    text = re.sub(r"\[\[(?:[^\]|]*\|)?([^\]]*)\]\]", r"\1", text)
    text = re.sub(r"\[https?://\S+\s([^\]]*)\]", r"\1", text)
    text = re.sub(r"\[?https?://\S+\]?", "", text)
    text = re.sub(r"'{2,}", "", text)
    text = re.sub(r"</?[a-zA-Z][^>]*>", "", text)
    text = re.sub(r"^\s*(=+)\s*(.*?)\s*\1\s*$", r"\2", text, flags=re.M)
    text = re.sub(r"^[*#:;]+\s*", "", text, flags=re.M)
    text = re.sub(r"[ \t]+", " ", text)
    text = re.sub(r"\n\s*\n+", "\n\n", text)
    return text.strip()


@lru_cache(maxsize=1)
def wiki_articles() -> tuple[tuple[str, str], ...]:
    """(title, plain text) of every non-redirect article, in dump order."""
    raw = bz2.open(wiki_path(), "rt", encoding="utf-8").read()
    out = []
    for page in re.findall(r"<page>(.*?)</page>", raw, re.S):
        title = re.search(r"<title>(.*?)</title>", page).group(1)
        body = re.search(r"<text[^>]*>(.*?)</text>", page, re.S)
        if body is None or body.group(1).lstrip().upper().startswith("#REDIRECT"):
            continue
        text = clean_wikitext(body.group(1))
        if len(text) > 200:
            out.append((html.unescape(title), text))
    return tuple(out)


def wiki_split(split: str) -> list[str]:
    if split not in ("train", "test"):
        raise ValueError(f"unknown split '{split}' (train or test)")
    arts = wiki_articles()
    return [t for i, (_, t) in enumerate(arts) if (i % 5 == 0) == (split == "test")]


def news_split(split: str) -> list[str]:
    if split not in ("train", "test"):
        raise ValueError(f"unknown split '{split}' (train or test)")
    p = package_dir("gensim", INSTALL_HINT) / "test" / "test_data" / NEWS_FILE
    if not p.exists():
        raise DataUnavailable(f"{p} is missing from the installed gensim; reinstall with: {INSTALL_HINT}")
    arts = [line.strip() for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [t for i, t in enumerate(arts) if (i % 5 == 0) == (split == "test")]


TEXT_SOURCES = {"wiki": wiki_split, "news": news_split}


def texts(source: str, split: str) -> list[str]:
    if source not in TEXT_SOURCES:
        raise ValueError(f"unknown text source '{source}'; choose one of {', '.join(TEXT_SOURCES)}")
    return TEXT_SOURCES[source](split)


def token_stream(tokenizer, docs: list[str]) -> torch.Tensor:
    """All documents tokenized (no special tokens) and joined with blank lines."""
    ids = tokenizer("\n\n".join(docs), add_special_tokens=False, verbose=False).input_ids
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, seq_len: int, count: int | None = None, seed: int | None = None) -> torch.Tensor:
    """Non-overlapping windows of ``seq_len`` tokens (count, seq_len).

    ``seed=None`` takes them in order; otherwise a seeded random choice of distinct
    windows (the paper does not say how it draws them).
    """
    total = stream.numel() // seq_len
    if total == 0:
        raise ValueError(f"sequence length {seq_len} is longer than the text ({stream.numel()} tokens)")
    count = total if count is None else count
    if count > total:
        raise ValueError(f"asked for {count} windows of {seq_len} tokens but the text holds only {total}")
    w = stream[: total * seq_len].view(total, seq_len)
    if seed is None:
        return w[:count]
    g = torch.Generator().manual_seed(seed)
    return w[torch.randperm(total, generator=g)[:count]]


_STREAMS: dict[tuple, torch.Tensor] = {}
_PROBE = "Calibration probe: The quick brown fox jumps over 13 lazy dogs. Ünïcödé — 東京."


def _tokenizer_key(tokenizer) -> tuple:
    ids = tokenizer(_PROBE, add_special_tokens=False, verbose=False).input_ids
    return type(tokenizer).__name__, getattr(tokenizer, "name_or_path", ""), len(tokenizer), tuple(ids)


@dataclass
class CalibrationData:
    """The calibration banks of the paper's Table 7: disjoint train and held-out windows.

    ``source`` is a packaged corpus (``wiki``: the training articles, the offline stand-in
    for WikiText-2 train) or a path to a text file or a folder of ``*.txt`` files (e.g. a
    local WikiText-2 ``wiki.train.raw``). The text is tokenized as one stream and
    ``train + heldout`` random non-overlapping windows of ``seq_len`` tokens are drawn with
    ``seed``: the first ``train`` form the train bank, the rest the held-out bank.
    Defaults are the paper's: 128 + 32 windows of 2048 tokens, batch 4, seed 0.
    """

    source: str = "wiki"
    split: str = "train"
    seq_len: int = 2048
    train: int = 128
    heldout: int = 32
    batch_size: int = 4
    seed: int = 0

    def __post_init__(self):
        for what in ("seq_len", "train", "heldout", "batch_size"):
            if int(getattr(self, what)) < 1:
                raise ValueError(f"calibration {what} must be at least 1, got {getattr(self, what)}")
        if self.seq_len < 2:
            raise ValueError(f"calibration seq_len must be at least 2, got {self.seq_len}")
        if self.source in TEXT_SOURCES and self.split == "test":
            raise ValueError(f"calibration must not read the '{self.source}' test split (it is the evaluation text)")

    def texts(self) -> list[str]:
        """The documents to calibrate on; DataUnavailable with the reason if there are none."""
        if self.source in TEXT_SOURCES:
            try:
                docs = texts(self.source, self.split)
            except DataUnavailable as e:
                raise DataUnavailable(f"no calibration data available: {e}") from None
        else:
            p = Path(self.source).expanduser()
            if not p.exists():
                raise DataUnavailable(
                    f"no calibration data available: '{self.source}' is neither a packaged corpus "
                    f"({', '.join(TEXT_SOURCES)}) nor an existing file or folder"
                )
            files = sorted(p.glob("*.txt")) if p.is_dir() else [p]
            docs = [f.read_text(encoding="utf-8", errors="replace") for f in files]
        docs = [d for d in docs if d.strip()]
        if not docs:
            raise DataUnavailable(f"no calibration data available: '{self.source}' ({self.split}) holds no text")
        return docs

    def check(self) -> None:
        """Cheap check that the text exists and can hold the banks (no tokenizer needed: a token
        covers at least one byte of the text, so the text's bytes bound its tokens)."""
        size = len("\n\n".join(self.texts()).encode("utf-8"))
        need = (self.train + self.heldout) * self.seq_len
        if size < need:
            raise DataUnavailable(
                f"calibration text '{self.source}' ({self.split}) is too short: {self.train} + {self.heldout} "
                f"windows of {self.seq_len} tokens need {need} tokens, and its {size} bytes hold at most {size}"
            )

    def stream(self, tokenizer) -> torch.Tensor:
        """The tokenized text, kept in memory for the next calibration of this process."""
        key = (self.source, self.split, _tokenizer_key(tokenizer))
        if key not in _STREAMS:
            docs = self.texts()
            _STREAMS.clear()
            _STREAMS[key] = token_stream(tokenizer, docs)
        return _STREAMS[key]

    def banks(self, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
        """(train, heldout) token windows, shapes (train, seq_len) and (heldout, seq_len)."""
        stream = self.stream(tokenizer)
        n = stream.numel()
        if self.seq_len > n:
            raise ValueError(
                f"calibration sequence length {self.seq_len} is longer than the data "
                f"({n} tokens in '{self.source}' {self.split})"
            )
        total = n // self.seq_len
        need = self.train + self.heldout
        if need > total:
            raise ValueError(
                f"calibration needs {self.train} + {self.heldout} windows of {self.seq_len} tokens but "
                f"'{self.source}' {self.split} holds only {total} ({n} tokens)"
            )
        w = windows(stream, self.seq_len, need, self.seed)
        return w[: self.train], w[self.train :]

    def to_dict(self) -> dict:
        return asdict(self)
