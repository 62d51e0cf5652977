"""Writing matplotlib figures as small PNGs.

The project's plots are lines and markers in a handful of colours. Saved as matplotlib writes
them (RGBA, anti-aliased), each is four times the size of the same image with a palette of 32
colours, which looks the same. Size matters here: the tracked files, committed plots included,
travel to the GPU machine with every command, under a size limit (``../shared/gpu``).
"""

from __future__ import annotations

import io
import os
from typing import Any

__all__ = ["PALETTE_COLOURS", "save_png"]

#: Colours of the palette a figure is reduced to.
PALETTE_COLOURS = 32


def save_png(fig: Any, path: str | os.PathLike, dpi: int) -> None:
    """Save ``fig`` to ``path`` as a PNG with a palette of :data:`PALETTE_COLOURS` colours.

    Raises what writing ``path`` raises (``OSError``).
    """
    from PIL import Image  # matplotlib's own dependency

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    buffer.seek(0)
    with Image.open(buffer) as image:
        palette = image.convert("RGB").quantize(colors=PALETTE_COLOURS)
        palette.save(path, format="PNG", optimize=True)
