"""Layer: host core. The one exception type the host raises for user mistakes.

Its message is a single line meant for a terminal; the bridge prints it without a traceback.
"""
from __future__ import annotations


class KllmConfigError(ValueError):
    """A bad plugin name, option value or combination, reported as one line."""
