"""Serve any rollout engine as its own process over HTTP, speaking SGLang's native API and OpenAI's.

``python -m relax_rollout.server --model DIR [--port P] [--host 127.0.0.1] [--token T]
[--max-queued-requests N]``

Why: the rollout manager, the elastic-scaling API and the ``external`` engine drive engines over HTTP, so
the same client code runs against a real SGLang server on a GPU and against our CPU ``TorchEngine`` here.
The wire formats therefore follow SGLang exactly where we implement an endpoint; read from
sgl-project/sglang ``python/sglang/srt/entrypoints/http_server.py`` (routes, response bodies),
``python/sglang/srt/managers/io_struct.py`` (request dataclasses), ``managers/schedule_batch.py``
(finish reasons), ``managers/tokenizer_manager.py`` (``meta_info``) and docs.sglang.io
"Sampling Parameters":

- ``POST /generate``: ``text`` or ``input_ids`` (one prompt or a batch), ``sampling_params`` (one dict or
  one per prompt: ``max_new_tokens`` (default 128), ``temperature`` (0 = greedy), ``top_p``,
  ``min_new_tokens``, ``stop_token_ids``, ``stop`` (up to 32 strings), ``no_stop_trim``, ``ignore_eos``,
  ``sampling_seed``), ``return_logprob``, ``top_logprobs_num`` (0-20, with ``return_logprob``),
  ``return_text_in_logprobs``, ``rid``,
  ``return_routed_experts`` (with ``--enable-return-routed-experts`` on an MoE model; and
  ``routed_experts_start_len``). Media (``image_data``, ``video_data``, ``audio_data``) are refused with a
  400 (empty lists, SGLang's batch form for text-only prompts, pass).
  Returns ``{"text", "output_ids", "meta_info"}`` (a list for a batch); ``meta_info`` has ``id``,
  ``finish_reason`` (``{"type": "stop", "matched": id or stop string}``, ``{"type": "length", "length": n}``,
  ``{"type": "abort", "message"}``), ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``,
  ``weight_version`` (a string, as SGLang's ``server_args.weight_version``), ``e2e_latency`` and, with
  ``return_logprob``, ``output_token_logprobs`` = ``[[logprob, token_id, text], ...]`` (text None without
  ``return_text_in_logprobs``) and with ``top_logprobs_num`` k ``output_top_logprobs``, per token k such
  triples. As SGLang: ``text`` is cut before the matched stop string or stop token (kept with
  ``no_stop_trim``); ``output_ids`` and the log-probs keep every generated token, the one completing a stop
  string included. ``input_token_logprobs`` is not computed. With
  ``return_routed_experts``: ``routed_experts`` = base64 of the int32 ``[prompt + generated - 1 - start,
  layers, top_k]`` expert ids, as SGLang sends them.
- Streams (``"stream": true`` on ``/generate``, chat and completions): server-sent events, token by token
  from an engine that streams (``"stream"`` in its features: the torch engine, the ``sglang`` engine and
  the engine pool), one event per response once complete from the others (``server.streaming``).
  ``/generate``'s chunks are the reply so far, as SGLang's (``text`` and ``output_ids`` cumulative,
  ``finish_reason`` null until the last); OpenAI's are deltas (``n`` choices interleaved by ``index``),
  then the finish reasons, then the usage with ``stream_options.include_usage``. A client that
  disconnects aborts its request; an error after the first event ends the stream with
  ``{"error": {...}}``.
- ``GET /metrics``: Prometheus metrics under SGLang's names, labels and buckets (``server.metrics``:
  ``sglang:time_to_first_token_seconds``, ``inter_token_latency_seconds``, ``e2e_request_latency_seconds``,
  ``queue_time_seconds``, ``prompt_tokens_total``, ``generation_tokens_total``, ``num_requests_total``,
  ``num_aborted_requests_total``, ``gen_throughput``, ``num_running_reqs``, ``num_queue_reqs``, ...),
  OpenMetrics when the ``Accept`` header asks for it, else the text format 0.0.4.
- ``GET /server_info`` (and SGLang's older name ``/get_server_info``): the settings and state SGLang
  reports there that apply here (``served_model_name``, ``context_length``, ``disable_radix_cache``,
  ``internal_states[0].last_gen_throughput``, ``version``, ...).
- ``GET /health`` (200, empty body), ``GET /model_info`` (and its deprecated name ``/get_model_info``:
  ``model_path``, ``tokenizer_path``,
  ``is_generation``, ``preferred_sampling_params``, ``weight_version``), ``GET /get_weight_version``.
- Weights: ``POST /update_weights_from_disk`` (``model_path``, ``weight_version``, ``abort_all_requests``
  → ``{"success", "message", "num_paused_requests"}``); ``POST /init_weights_update_group``
  (``master_address``, ``master_port``, ``rank_offset``, ``world_size``, ``group_name``, ``backend``) joins
  rank 0's weight group as SGLang builds it (``relax_rollout.engines.weight_group``); each
  ``POST /update_weights_from_distributed`` — only inside a session, ``POST /begin_weight_update`` …
  ``POST /end_weight_update``, as SGLang 0.5.23 (HTTP 400 ``{"success": false, "message"}`` otherwise, and
  for every weight request not carried out) — (``names``/``dtypes``/``shapes``, ``group_name``,
  ``load_format`` ``flattened_bucket`` or per-tensor, ``flush_cache``, ``abort_all_requests``,
  ``weight_version``) then takes its tensors from rank 0's broadcast, applied with the request that carries
  ``weight_version`` or ``flush_cache``. With ``"protocol": "relax_dcs"`` (a relax extension) the server
  joins a relax DCS ``WeightSender`` instead, as a ``WeightReceiver`` applying every version pushed, and
  ``/update_weights_from_distributed`` waits until its ``weight_version`` is applied; ``POST /destroy_weights_update_group``.
  ``/update_weights_from_tensor`` answers 400 saying why: SGLang's payload is a pickled CUDA-IPC handle.
- ``POST /pause_generation`` (``mode``: ``abort`` (default) aborts in-flight requests, which return with
  finish reason abort; ``in_place``/``retract`` hold them at the next decode step, weights may be
  updated meanwhile) — new requests wait until ``POST /continue_generation``, as in SGLang's tokenizer
  manager. Bodies ``{"message": "Generation paused successfully.", "status": "ok"}``.
- ``POST /abort_request`` (``rid`` or ``abort_all``) → 200, empty body.
- Errors: 400 with ``{"object": "error", "message", "type", "param", "code"}`` (SGLang's
  ``ErrorResponse``; ``param`` names the bad field).
- OpenAI: ``GET /v1/models``, ``POST /v1/chat/completions`` (the tokenizer's chat template, ChatML when it
  has none; ``stop`` up to 4 strings, ``logprobs`` with ``top_logprobs`` up to 20; ``image_url`` content
  parts as ``data:`` URLs for a Qwen-VL/Omni model, expanded by relax-multimodal (``server.media``), not in
  agent sessions), ``POST /v1/completions`` (``logprobs`` up to 20). Extensions so a trainer can record exact tokens: ``choices[i].token_ids`` and
  ``prompt_token_ids`` (vLLM's names), ``weight_version``, and SGLang's ``choices[i].matched_stop``.
  An engine without top log-probs or stop strings (its ``features``) gets a 400 naming the field.
- Relax extension: ``GET /weights_checksum`` (for weight-sync verification).
- Agents outside the engine (``trajectories``): a chat call naming a session (``X-Relax-Session`` header,
  else OpenAI's ``user``) is recorded token in / token out; a later call repeating the history continues
  from the recorded ids. ``GET /relax/trajectories`` (sessions and summaries),
  ``GET /relax/trajectories/<session>[?index=N]`` (tokens, prompt_len, loss_mask, rollout_log_probs, ...),
  ``POST /relax/trajectories/<session>/close`` (``{"reward": x}``); ``to_bus_sample`` makes a training
  sample of one. Unknown session: 404.

Load: ``--max-queued-requests N`` (default 256; 0: no bound; ``EngineServer.max_queued_requests``) bounds
the generation requests (``/generate``, ``/v1/chat/completions``, ``/v1/completions``) admitted at once,
running or waiting for the engine; one more is refused at once with HTTP 503, the error body above (``type``
``Overloaded``, the message naming the limit) and ``Retry-After: 1``, counted in ``GET /metrics`` as
``relax:num_refused_requests_total``. Other routes (``/health``, ``/metrics``, model info, weights, pause)
are never refused and keep threads of their own, so health checks pass under a flood.

Security: binds 127.0.0.1 by default. Another ``--host`` requires ``--token``; with a token, control
endpoints (weights, pause/continue, abort) and ``/relax/...`` need ``Authorization: Bearer <token>`` (401
otherwise).
"""

from relax_rollout.server.app import make_server
from relax_rollout.server.state import EngineServer

__all__ = ["EngineServer", "make_server"]
