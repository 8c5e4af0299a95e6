"""Does the budget hold on text of other domains? Rewritten graphs against their original on corpora no calibration
window comes from.

    python benchmarks/domains.py ORIGINAL REWRITTEN [REWRITTEN ...] [--windows 32] [--corpora fortunes,gcide,devil]

The corpora come from Debian packages (`apt-get install fortunes dict-gcide dict-devil`; none is in the built-in
corpus, and none is read by a test or by any default):
    fortunes   the fortune-mod quotations (literature, humour, proverbs; the software-themed files left out)
    gcide      the Collaborative International Dictionary of English (Webster 1913 + WordNet), every 60th entry
    devil      Ambrose Bierce's The Devil's Dictionary (1911)
Each is written once as a .txt under out/domains/ and scored on WINDOWS windows spread over its whole token stream
(`--part all`: every window is unseen by the job). Prints one markdown row per corpus and rewritten graph: mean
token KL with its 95 % interval, top-1 agreement and dNLL against the original.
"""

from __future__ import annotations

import argparse
import gzip
import re
from pathlib import Path

from common import ROOT, table

from surgery.measure import scoring, statistics
from surgery.text import data

FOLDER = ROOT / "out" / "domains"
FORTUNES = Path("/usr/share/games/fortunes")
SOFTWARE = {"ascii-art", "computers", "debian", "linux", "linuxcookie", "knghtbrd", "perl"}
DICTD = Path("/usr/share/dictd")


def fortunes() -> str:
    entries = []
    for path in sorted(FORTUNES.iterdir()):
        if path.is_file() and not path.suffix and path.name not in SOFTWARE:
            text = path.read_text(encoding="utf-8", errors="replace")
            entries += [e.strip("\n") for e in text.split("\n%\n") if e.strip()]
    return "\n\n".join(entries)


def dictionary(name: str, every: int) -> str:
    with gzip.open(DICTD / f"{name}.dict.dz", "rt", encoding="utf-8", errors="replace") as f:
        text = f.read()
    entries = [e for e in re.split(r"\n\s*\n", text) if len(e) > 40][10::every]  # past the database's own header
    return "\n\n".join(re.sub(r"[ \t]+", " ", e).strip() for e in entries)


CORPORA = {"fortunes": fortunes, "gcide": lambda: dictionary("gcide", 60), "devil": lambda: dictionary("devil", 1)}


def corpus(name: str) -> Path:
    """The corpus's .txt under out/domains/, written on first use."""
    path = FOLDER / f"{name}.txt"
    if not path.is_file():
        FOLDER.mkdir(parents=True, exist_ok=True)
        try:
            text = CORPORA[name]()
        except FileNotFoundError as e:
            raise SystemExit(f"{e.filename} is missing: apt-get install fortunes dict-gcide dict-devil") from None
        path.write_text(text, encoding="utf-8")
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="+", help="the original first, then the rewritten graphs")
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--corpora", default=",".join(CORPORA))
    args = parser.parse_args()
    rows = []
    for name in args.corpora.split(","):
        ws = data.windows(args.models[0], corpus(name), seq_len=256, max_windows=args.windows, part="all")
        results = scoring.compare(args.models, ws)
        for model, score in zip(args.models[1:], results[1:]):
            div, dnll = statistics.divergence(score), statistics.delta(results[0], score)
            rows.append({
                "corpus": f"{name} ({len(ws)} windows, {ws.tokens} tokens)",
                "model": model,
                "KL [95 %]": str(div),
                "top-1": f"{100 * div.top1:.1f} %",
                "dNLL [95 %]": str(dnll),
            })
            print(rows[-1], flush=True)
    print(table(rows, ["corpus", "model", "KL [95 %]", "top-1", "dNLL [95 %]"]))


if __name__ == "__main__":
    main()
