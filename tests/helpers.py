"""Small helpers shared by the test modules."""
from __future__ import annotations


def flat(x):
    """A nested list/tuple of results as a flat list."""
    if isinstance(x, (list, tuple)):
        return [e for y in x for e in flat(y)]
    return [x]
