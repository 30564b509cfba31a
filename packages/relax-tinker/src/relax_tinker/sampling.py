"""Sampling sessions served by Relax's torch rollout engine, concurrent requests batched.

A sampling session is a snapshot: the adapter a training client had when it saved weights for the sampler
(or none: the base model). Each adapter configuration has an engine (the torch engine with the adapter merged
into its weights, as in a LoRA RL run); a request on a session whose adapter the engine does not hold loads
that snapshot first (an adapter is small: the load is a copy of its tensors and a merge), so old sessions stay
exact. Requests that arrive together on one session with the same parameters generate as one batch, as the
cookbook's group of ``num_samples=1`` requests does.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from relax_tinker.wire import encode_sample

BATCH_WAIT_S = 0.02
"""How long the batcher waits for more requests after the first (the cookbook sends a batch at once)."""
DEFAULT_MAX_TOKENS = 128


@dataclass(frozen=True)
class SampleParams:
    """The API's ``sampling_params`` (what a batch must share)."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_tokens: tuple[int, ...] = ()

    @classmethod
    def from_api(cls, p: dict[str, Any]) -> SampleParams:
        """From the request's JSON; what the engine cannot do is refused naming the field."""
        top_k = p.get("top_k", -1)
        if top_k not in (-1, 0, None):
            raise ValueError(
                f"sampling_params.top_k={top_k}: the torch engine samples without a top-k cut; use -1"
            )
        stop = p.get("stop")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        return cls(
            max_tokens=int(p.get("max_tokens") or DEFAULT_MAX_TOKENS),
            temperature=float(p.get("temperature", 1.0)),
            top_p=float(p.get("top_p", 1.0)),
            seed=p.get("seed"),
            stop=tuple(s for s in stops if isinstance(s, str)),
            stop_tokens=tuple(int(s) for s in stops if isinstance(s, int)),
        )


@dataclass
class Snapshot:
    """A sampling session's weights: the adapter's tensors at one save (None: the base model)."""

    session_id: str
    base_model: str
    version: int
    adapter: dict[str, Any] | None = None
    model_id: str | None = None
    model_path: str | None = None


@dataclass
class _Request:
    snapshot: Snapshot
    prompt: list[int]
    n: int
    params: SampleParams
    prompt_logprobs: bool
    future: Future = field(default_factory=Future)


def build_engine(kind: str, model_path: str, lora: dict[str, Any] | None, dtype: str = "float32") -> Any:
    """A sampler's engine for one adapter configuration (``lora``: peft's config dict; None: the base
    model): ``process``, the engine server in a process of its own taking adapters over DCS; ``local``, the
    torch engine in this process taking them by a copy."""
    if kind == "process":
        from relax_tinker.engine_process import ProcessEngine

        return ProcessEngine(model_path, lora, dtype)
    if kind == "local":
        from relax_rollout.engines.torch_engine import TorchEngine

        return TorchEngine(model_path=model_path, lora=lora, dtype=dtype)
    raise ValueError(f"sampler {kind!r}: 'process' or 'local'")


class Sampler:
    """An engine for one adapter configuration and the thread that batches its requests."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        """The torch engine in this process, or :class:`~relax_tinker.engine_process.ProcessEngine`."""
        self.loaded: str | None = None
        """The session whose adapter the engine holds now."""
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="relax-tinker-sampler", daemon=True)
        self._thread.start()

    def submit(
        self, snapshot: Snapshot, prompt: list[int], n: int, params: SampleParams, prompt_logprobs: bool
    ) -> Future:
        """A future of the ``SampleResponse`` (protobuf bytes) of ``n`` samples of ``prompt``."""
        if not prompt:
            raise ValueError("the prompt has no tokens")
        req = _Request(snapshot, prompt, n, params, prompt_logprobs)
        self._queue.put(req)
        return req.future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
        if hasattr(self.engine, "close"):
            self.engine.close()

    def _take(self) -> list[_Request] | None:
        first = self._queue.get()
        if first is None:
            return None
        batch = [first]
        try:
            while True:
                nxt = self._queue.get(timeout=BATCH_WAIT_S)
                if nxt is None:
                    self._queue.put(None)
                    break
                batch.append(nxt)
        except queue.Empty:
            pass
        return batch

    def _loop(self) -> None:
        while (batch := self._take()) is not None:
            groups: dict[tuple[str, SampleParams, bool], list[_Request]] = {}
            for r in batch:
                groups.setdefault((r.snapshot.session_id, r.params, r.prompt_logprobs), []).append(r)
            for reqs in groups.values():
                try:
                    self._generate(reqs)
                except Exception as e:  # (each request's future carries it: the loop serves on)
                    for r in reqs:
                        if not r.future.done():
                            r.future.set_exception(e)

    def _generate(self, reqs: list[_Request]) -> None:
        from relax_rollout.engines.base import SamplingParams

        snap, p = reqs[0].snapshot, reqs[0].params
        if snap.adapter is not None and self.loaded != snap.session_id:
            self.engine.update_weights(snap.adapter, snap.version)
            self.loaded = snap.session_id
        params = SamplingParams(
            max_new_tokens=p.max_tokens,
            temperature=max(p.temperature, 1e-6),
            top_p=p.top_p,
            greedy=p.temperature == 0,
            stop=p.stop,
            stop_token_ids=p.stop_tokens,
            seed=p.seed,
            input_logprobs=reqs[0].prompt_logprobs,
        )
        prompts = [r.prompt for r in reqs for _ in range(r.n)]
        outs = self.engine.generate(prompts, params)
        k = 0
        for r in reqs:
            mine, k = outs[k : k + r.n], k + r.n
            seqs = [
                (o.token_ids, o.log_probs, "length" if o.finish_reason == "length" else "stop") for o in mine
            ]
            r.future.set_result(encode_sample(seqs, mine[0].input_logprobs if r.prompt_logprobs else None))
