"""Corpora -> text. The embedded default corpus is Python's own documentation topics."""

from __future__ import annotations


def default_corpus() -> str:
    """The English text of `pydoc_data.topics` (shipped with every CPython), joined in sorted key order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))
