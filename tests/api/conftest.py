"""API tests reuse the agent daemon fixture (a real daemon on a temp socket)."""
from __future__ import annotations

from tests.agent.conftest import Daemon, daemon, daemon_factory, shared_daemon, trainer_factory  # noqa: F401


def refuse_all(request):
    """A layout chooser (config inference.layout_chooser) that finds 12.5 rps is all the free cores carry."""
    from reamer.search.chooser import LayoutChoice

    rate = request.rate_rps
    return LayoutChoice("1x1:b1", accepted=rate is None or rate <= 12.5, achievable_rps=12.5, reason="measured profile")
