"""matplotlib for the benchmark's charts, headless, or None where it is not installed.

Charts are optional: every report is written without them, and the first chart that
cannot be drawn says so once per process.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("fczero.bench")


@functools.cache
def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None (logged once) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no charts (pip install matplotlib)")
        return None
    return plt
