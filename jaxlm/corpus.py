"""The offline text the default tokenizers and the no-input demos train on.

`pydoc_data.topics` ships with CPython (about 1 MB of English about Python), so a fresh
machine can build a vocabulary, shards and a model with no download.
"""


def pydoc_corpus() -> str:
    """Every pydoc topic, in sorted key order (deterministic), joined by newlines."""
    from pydoc_data import topics
    return "\n".join(topics.topics[k] for k in sorted(topics.topics))
