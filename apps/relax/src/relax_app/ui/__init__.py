"""`relax ui RUN_DIR`: a run explorer in the browser, for a live run and a finished run directory alike.

Live curves (reward, held-out accuracy, samples/s, staleness, rollout–trainer mismatch, weight sync, the
critic's fit), a rollout browser (a step's groups side by side, every token coloured by the policy version
that produced it or by its trainer–rollout mismatch, multi-turn and tool tokens marked, a sample's media),
and the run's timeline (roles' phases, restarts, bus depth). It reads only what the run writes
(:mod:`relax_app.ui.data`); the page is served by :mod:`relax_app.ui.server`.
"""

from __future__ import annotations

import argparse
import sys


def ui_main(argv: list[str]) -> int:
    """`relax ui RUN_DIR [--host H] [--port P] [--token T]`: serve the run explorer until Ctrl-C."""
    from relax_app.ui.server import build_app
    from relax_rollout.http_api import Served, check_bind

    ap = argparse.ArgumentParser(prog="relax ui", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="a run's --output-dir (running or finished)")
    ap.add_argument(
        "--host", default="127.0.0.1", help="address to bind (another than loopback needs --token)"
    )
    ap.add_argument("--port", type=int, default=8610, help="port (0: any free one)")
    ap.add_argument("--token", default=None, help="required by the page's data routes (give it as ?token=)")
    args = ap.parse_args(argv)
    try:
        check_bind(args.host, args.token, "relax ui (--host / --token)")
    except ValueError as e:
        print(f"relax: {e}", file=sys.stderr)
        return 2
    served = Served(build_app(args.run_dir, args.token), args.host, args.port)
    host, port = served.server_address[:2]
    query = f"?token={args.token}" if args.token else ""
    print(f"relax ui: {args.run_dir} at http://{host}:{port}/{query} (Ctrl-C stops)", flush=True)
    served.serve_forever()
    return 0
