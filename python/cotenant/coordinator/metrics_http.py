"""The Prometheus endpoint: prometheus_client's handler behind limits.

It listens on the loopback address unless told otherwise (the metrics name
every job), closes a connection that sends nothing for `idle_timeout_s`, and
serves at most `max_connections` at once: more are closed on arrival, so idle
or slow clients cannot use up the daemon's threads and descriptors.
"""

from __future__ import annotations

import socket
import threading
from http.server import ThreadingHTTPServer
from typing import Any, Tuple

from prometheus_client.exposition import MetricsHandler


class _BoundedServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: Tuple[str, int], handler: Any, max_connections: int) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # at the limit: closed at once
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def serve_metrics(registry: Any, address: str, port: int, idle_timeout_s: float,
                  max_connections: int = 16) -> ThreadingHTTPServer:
    """Serves `registry` on http://address:port/ from a daemon thread; raises
    OSError when the address cannot be bound (in use, not local)."""
    handler = type("CotenantMetricsHandler", (MetricsHandler.factory(registry),), {"timeout": idle_timeout_s})
    server = _BoundedServer((address, port), handler, max_connections)
    threading.Thread(target=server.serve_forever, name="cotenant-metrics", daemon=True).start()
    return server
