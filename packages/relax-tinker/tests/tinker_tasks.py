"""Our server on a free port in this process (a thread), for relax-tinker's tests."""

from __future__ import annotations

import threading


class Server:
    """A :class:`~relax_tinker.service.TinkerService` served on a free port by a thread."""

    def __init__(self, model: str, root, token: str | None = None, sampler: str = "local") -> None:
        from relax_rollout.http_api import Served
        from relax_tinker.server import build_app
        from relax_tinker.service import TinkerService

        self.service = TinkerService(model, root, sampler=sampler)
        self.served = Served(build_app(self.service, token))
        host, port = self.served.server_address[:2]
        self.url = f"http://{host}:{port}"
        self.thread = threading.Thread(target=self.served.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.served.shutdown()
        self.served.server_close()
        self.service.close()
