"""Training text for healing the converted SmolLM2 MLA model: packaged, real, held apart from evaluation.

Sources (each a list of documents):

- ``wiki``: the ``train`` split of :func:`quantmla.data.wiki_split` (the ``test`` split is
  the perplexity text and is never read here); CC BY-SA.
- ``lee``: ``lee_background.cor`` from the gensim wheel, 300 news articles (gensim's test data).
- ``bible``: the King James Bible from Debian ``bible-kjv`` (public domain), one document per book.
- ``austen``: the six novels of Debian ``r-cran-janeaustenr`` (public domain), read with PyPI ``rdata``.

None of them is an evaluation text of the project (HellaSwag, PIQA, ARC, the RULER essays,
the held-out Wikipedia articles).
"""

from __future__ import annotations

import gzip
import re
import shutil
import subprocess
import warnings
import zlib
from pathlib import Path

from quantmla import data

BIBLE_HINT = "apt-get install bible-kjv"
AUSTEN_DIR = Path("/usr/lib/R/site-library/janeaustenr/data")
AUSTEN_HINT = "apt-get install r-cran-janeaustenr && pip install rdata"


def wiki() -> list[str]:
    return data.wiki_split("train")


def lee() -> list[str]:
    p = data.package_dir("gensim", data.INSTALL_HINT) / "test" / "test_data" / "lee_background.cor"
    if not p.exists():
        raise data.DataUnavailable(f"{p} is missing; reinstall with: {data.INSTALL_HINT}")
    return [line.strip() for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]


def bible() -> list[str]:
    exe = shutil.which("bible")
    if exe is None:
        raise data.DataUnavailable(f"the 'bible' program is not installed; install it with: {BIBLE_HINT}")
    out = subprocess.run([exe, "-f", "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True).stdout
    books: dict[str, list[str]] = {}
    for line in out.splitlines():
        m = re.match(r"^(\d?\s?[A-Za-z]+)(\d+):(\d+)\s+(.*)$", line.strip())
        if m:
            books.setdefault(m.group(1), []).append(m.group(4))
    if not books:
        raise data.DataUnavailable("'bible -f' printed no verses; reinstall with: " + BIBLE_HINT)
    return [" ".join(verses) for verses in books.values()]


def austen() -> list[str]:
    idx, rdb = AUSTEN_DIR / "Rdata.rdx", AUSTEN_DIR / "Rdata.rdb"
    if not idx.exists():
        raise data.DataUnavailable(f"{AUSTEN_DIR} is missing; install with: {AUSTEN_HINT}")
    try:
        import rdata
    except ImportError:
        raise data.DataUnavailable(f"PyPI rdata is not installed; install with: {AUSTEN_HINT}") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress(idx.read_bytes())))
        blob = rdb.read_bytes()
        novels = []
        for name in sorted(table["variables"]):
            off, n = (int(v) for v in table["variables"][name])
            lines = rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(blob[off + 4 : off + n])))
            text = "\n".join(str(x) for x in lines)
            novels.append(re.sub(r"(?<!\n)\n(?!\n)", " ", text))  # unwrap lines, keep paragraphs
    return novels


SOURCES = {"wiki": wiki, "lee": lee, "bible": bible, "austen": austen}


def documents(names: list[str] | None = None) -> dict[str, list[str]]:
    """Documents of every training source (or of ``names``); a missing one raises DataUnavailable."""
    names = list(SOURCES) if names is None else names
    unknown = [n for n in names if n not in SOURCES]
    if unknown:
        raise ValueError(f"unknown healing source(s) {unknown}; choose from {', '.join(SOURCES)}")
    return {n: SOURCES[n]() for n in names}
