"""Values that the Trainer callback logs are read on a console: keep each under `WIDTH` characters.

transformers' console printer replaces any logged string over 100 characters with "[String too
long to display ...]" (`log_history` keeps the whole value); the details go to the swap report.
"""
from __future__ import annotations

WIDTH = 100


def fit(text: str, width: int = WIDTH) -> str:
    """`text`, cut to `width` characters with "..." at the end when it is longer."""
    return text if len(text) <= width else text[: width - 3] + "..."
