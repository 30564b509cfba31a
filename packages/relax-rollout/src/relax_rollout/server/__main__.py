"""``python -m relax_rollout.server --model DIR``: load a TorchEngine (or ``--engine NAME``) and serve it."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m relax_rollout.server", description=__doc__)
    ap.add_argument("--model", required=True, help="HF checkpoint directory (weights + tokenizer)")
    ap.add_argument("--host", default="127.0.0.1", help="bind address (non-loopback needs --token)")
    ap.add_argument("--port", type=int, default=30000, help="port (0 = any free port; printed on start)")
    ap.add_argument("--token", default=None, help="bearer token required by control endpoints")
    ap.add_argument("--engine", default="torch", help="engine name in relax_rollout.engines.ENGINES")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--torch-threads", type=int, default=None)
    ap.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="record each token's MoE experts (SGLang's flag): /generate may then ask for "
        "return_routed_experts",
    )
    ap.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="generation requests (/generate, /v1/chat/completions, /v1/completions) admitted at once, "
        "running or waiting for the engine; one more is refused at once with HTTP 503 and Retry-After "
        "(default 256; 0: no bound)",
    )
    ap.add_argument(
        "--lora",
        default=None,
        help="serve the model with a LoRA adapter: peft's config as JSON (r, lora_alpha, target_modules); "
        "weight updates then carry the adapter's tensors (B = 0 until the first)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        ap.error(f"--max-queued-requests: must be 0 (no bound) or more (got {args.max_queued_requests})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from relax_core.hf_files import check_servable
    from relax_rollout.http_api import check_bind
    from relax_rollout.server.app import make_server
    from relax_rollout.server.state import EngineServer

    try:  # before the model loads
        check_bind(args.host, args.token, "--host / --token")
    except ValueError as e:
        ap.error(str(e))
    try:  # (without a tokenizer transformers builds an empty one: /tokenize [], chat a 500)
        check_servable(args.model)
    except ValueError as e:
        print(f"{ap.prog}: {e}", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoTokenizer

    from relax_rollout.engines import build_engine

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    routing: dict[str, Any] = {"record_routing": True} if args.enable_return_routed_experts else {}
    if args.lora:
        try:
            routing["lora"] = json.loads(args.lora)
        except json.JSONDecodeError as e:
            ap.error(f"--lora: not JSON ({e})")
    engine = build_engine(
        args.engine,
        model_path=args.model,
        dtype=args.dtype,
        eos_token_ids=[tok.eos_token_id],
        pad_token_id=tok.pad_token_id,
        **routing,
    )
    state = EngineServer(engine, tok, args.model, args.served_model_name or args.model, args.token)
    if args.max_queued_requests is not None:
        state.max_queued_requests = args.max_queued_requests or None
    httpd = make_server(state, args.host, args.port)
    host, port = httpd.server_address[:2]
    print(f"relax engine server listening on http://{host}:{port}", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        state.group.leave()
        httpd.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
