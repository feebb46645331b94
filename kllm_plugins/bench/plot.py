"""One way for a benchmark to draw a figure: `figure(path, ...)` yields a grid of matplotlib axes
and writes the PNG when the block ends, or yields None (and says so in one line) where matplotlib
is not installed: it is not a dependency of the project, and every figure a plot shows is in the
result summary already. SGLang-free.

    with figure(path, rows=1, cols=2, size=(10, 4)) as axes:
        if axes is not None:
            axes[0][0].plot(xs, ys, label="ours")
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator


def pyplot() -> Any | None:
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextmanager
def figure(path: str, rows: int = 1, cols: int = 1, size: tuple[float, float] | None = None,
           dpi: int = 110) -> Iterator[Any]:
    """Axes as a rows x cols list of lists (always two levels), or None without matplotlib; the
    figure is laid out, written to `path` (its folder made) and closed when the block ends."""
    plt = pyplot()
    if plt is None:
        print(f"plot skipped ({path}): matplotlib is not installed", file=sys.stderr)
        yield None
        return
    fig, axes = plt.subplots(rows, cols, figsize=size or (6.4 * cols, 4.2 * rows), squeeze=False)
    try:
        yield axes
        fig.tight_layout()
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        fig.savefig(path, dpi=dpi)
        print(f"plot: {path}", file=sys.stderr)
    finally:
        plt.close(fig)
