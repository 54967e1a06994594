"""The backend as a search dimension: "auto" (every installed backend competes, the chosen layout names its
backend) and which of reamer's backends (reamer.plan.layout.BACKENDS) are installed here."""
from __future__ import annotations

import importlib.util

from reamer.plan.layout import BACKENDS

AUTO = "auto"  # the backend is a search dimension: every installed backend competes


def installed_backends() -> list[str]:
    """The backends whose runtime is importable here, in reamer's order of preference."""
    return [b for b in BACKENDS if importlib.util.find_spec(b) is not None]
