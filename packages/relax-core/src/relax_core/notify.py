"""Run notifications (start, finish, failure, restart) through Apprise.

An RL run finishes or dies hours after launch, while nobody watches its terminal. ``--notify-urls`` sends
those moments to wherever the team looks (Slack, Discord, Telegram, ntfy, e-mail, a JSON webhook: any of
Apprise's services, one URL each). Apprise is optional (``relax-core[notify]``) and imported only when
URLs are given. Delivery never decides the run's fate: a notification that cannot be sent logs a warning.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)


def _schema(url: str) -> str:
    """The URL's service, never its secrets (tokens and passwords live in the rest of the URL)."""
    return url.split("://", 1)[0] + "://" if "://" in url else "(no scheme)"


class Notifier:
    """Sends run events to the ``--notify-urls``; with none it does nothing.

    Config mistakes (apprise missing, a URL Apprise cannot read) raise at construction, before the run
    starts; sending never raises."""

    def __init__(self, urls: Sequence[str] = (), run_name: str = "relax") -> None:
        self.urls = [u for u in urls if u]
        self.run_name = run_name
        self.host = socket.gethostname()
        self._t0 = time.time()
        self._apprise = None
        if not self.urls:
            return
        try:
            import apprise
        except ImportError as e:
            raise ImportError("--notify-urls needs apprise: pip install 'relax-core[notify]'") from e
        self._apprise = apprise.Apprise()
        for i, url in enumerate(self.urls):
            if not self._apprise.add(url):
                raise ValueError(
                    f"--notify-urls entry {i + 1} ({_schema(url)}...) is not a URL Apprise can use; "
                    "see https://github.com/caronc/apprise/wiki for each service's URL"
                )

    @property
    def enabled(self) -> bool:
        return self._apprise is not None

    def send(self, title: str, body: str, kind: str = "info") -> bool:
        """One notification to every URL (kind: info, success, warning, failure); True if all got it."""
        if self._apprise is None:
            return False
        try:
            ok = bool(self._apprise.notify(body=body, title=title, notify_type=kind))
        except Exception as exc:  # noqa: BLE001 - a notification must never break the run
            log.warning("notification %r failed: %s: %s", title, type(exc).__name__, exc)
            return False
        if not ok:
            log.warning("notification %r was not delivered to every --notify-urls service", title)
        return ok

    def _title(self, event: str) -> str:
        return f"Relax run {self.run_name} {event}"

    def start(self, details: dict[str, Any]) -> bool:
        self._t0 = time.time()
        lines = [f"host: {self.host}"] + [f"{k}: {v}" for k, v in details.items()]
        return self.send(self._title("started"), "\n".join(lines), "info")

    def finish(self, result: Any) -> bool:
        """``result``: the controller's RunResult (history, samples, wall_s, rl_wall_s, mode)."""
        figures = summary_figures(result)
        lines = [f"{k}: {v}" for k, v in figures.items() if v is not None]
        return self.send(self._title("finished"), "\n".join(lines), "success")

    def failure(self, exc: BaseException) -> bool:
        body = f"{type(exc).__name__}: {exc}\nafter {time.time() - self._t0:.1f} s on {self.host}"
        return self.send(self._title("failed"), body, "failure")

    def restart(self, attempt: int, reason: str = "") -> bool:
        """For a supervisor that restarts a failed run (from its last checkpoint)."""
        body = f"attempt {attempt}" + (f": {reason}" if reason else "") + f"\non {self.host}"
        return self.send(self._title("restarted"), body, "warning")


def summary_figures(result: Any) -> dict[str, Any]:
    """The figures a finish notification reports, from a RunResult."""
    trained = [h for h in result.history if "rollout/reward_mean" in h]
    evals = [h for h in result.history if "eval/accuracy" in h]
    return {
        "mode": result.mode,
        "steps": int(trained[-1]["step"]) if trained else 0,
        "samples": result.samples,
        "wall_s": round(result.wall_s, 1),
        "rl_wall_s": round(result.rl_wall_s, 1),
        "final_reward": round(float(trained[-1]["rollout/reward_mean"]), 4) if trained else None,
        "final_eval_accuracy": round(float(evals[-1]["eval/accuracy"]), 4) if evals else None,
        "trace": getattr(result, "trace_path", None),
    }
