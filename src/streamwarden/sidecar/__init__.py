"""The sidecar face: an aiohttp reverse proxy in front of one configured upstream."""

from streamwarden.sidecar.proxy import Proxy
from streamwarden.sidecar.server import Sidecar, run_sidecar
from streamwarden.sidecar.streams import StreamTracker

__all__ = ["Proxy", "Sidecar", "StreamTracker", "run_sidecar"]
