"""``python -m relax_tinker --model PATH``: the Tinker API on 127.0.0.1 (``--host`` elsewhere needs
``--token``, which clients send as their ``TINKER_API_KEY``). Point the SDK at it with
``base_url=http://127.0.0.1:PORT`` (or ``TINKER_BASE_URL``) and any ``TINKER_API_KEY`` starting ``tml-``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    from relax_rollout.http_api import Served, check_bind
    from relax_tinker.server import build_app
    from relax_tinker.service import TinkerService

    ap = argparse.ArgumentParser(prog="relax tinker-serve", description=__doc__)
    ap.add_argument("--model", required=True, help="the base model: a local HF directory (no hub downloads)")
    ap.add_argument("--name", action="append", default=[], help="another name clients may call the model by")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    ap.add_argument("--token", default=os.environ.get("RELAX_TINKER_TOKEN"), help="required off loopback")
    ap.add_argument("--root", default=None, help="where checkpoints go (default: a new temporary directory)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--sampler",
        choices=("process", "local"),
        default="process",
        help="process: each adapter's engine server runs apart, taking snapshots over DCS; local: in this process",
    )
    ap.add_argument(
        "--snapshots-in-memory",
        type=int,
        default=4,
        help="sampling sessions whose adapters stay in memory; older ones wait on disk under --root",
    )
    ap.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    check_bind(args.host, args.token, "relax tinker-serve")
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    root = Path(args.root or tempfile.mkdtemp(prefix="relax-tinker-"))
    if args.snapshots_in_memory < 1:
        raise ValueError(f"--snapshots-in-memory {args.snapshots_in_memory}: at least 1 (the session in use)")
    service = TinkerService(
        args.model, root, tuple(args.name), args.dtype, args.sampler, args.snapshots_in_memory
    )
    served = Served(build_app(service, args.token), args.host, args.port)
    host, port = served.server_address[:2]
    print(f"relax tinker-serve: checkpoints in {root}; listening on http://{host}:{port}", flush=True)
    try:
        served.serve_forever()
    finally:
        service.close()


def command(argv: list[str]) -> int:
    """``relax tinker-serve ...`` (an entry point of the ``relax`` command): a setting that cannot be used
    ends it with one line and exit code 2."""
    try:
        main(argv)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    main()
