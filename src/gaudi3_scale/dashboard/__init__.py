"""`gaudi3 dashboard`: a read-only web view of a runs directory (runs, live curves, resources, cost, benchmarks,
checkpoints). Needs Flask: `pip install 'gaudi3-scale[dashboard]'`; serves only its own files (no CDN).

    from gaudi3_scale.dashboard import create_app
    app = create_app(Path("runs"))            # loopback; off loopback: create_app(..., host=, token=)
"""

from __future__ import annotations

from gaudi3_scale.dashboard.app import create_app
from gaudi3_scale.dashboard.server import build_server, serve

__all__ = ["build_server", "create_app", "serve"]
