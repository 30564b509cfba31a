"""Continuous batching for the torch engine: requests join and leave the running batch between decode steps.

Why: a batch generated in one call runs as many decode steps as its longest response, and every finished
sequence keeps costing its row until then; with heavy-tailed response lengths most of that work is such
rows, and a new prompt waits for the whole batch (SGLang batches continuously for this reason). Here each
request is its own sequence with its own KV-cache rows, its own sampling parameters and its own random
generator (seeded by the request), so its tokens do not depend on what runs beside it: a finished
sequence leaves at once and a waiting one joins at the next decode step, its prompt prefilled on its own
rows and the caches joined (left padding, masked). The rollout can then submit groups as it goes and
take each one the moment its last response ends (streaming rollout).

Weights change between two decode steps (:meth:`ContinuousBatcher.update_weights`: the loop applies the
update itself at its next turn, so an update never waits behind a stream of steps): the tokens after it
carry the new version (``GenerateOutput.token_versions``) while the running sequences keep their prefixes
and their KV cache, computed under the weights of its time — as SGLang's in-place pause keeps it. This is
the torch engine's half of partial rollout; recomputing a prefix under the new weights is the
abort-and-resubmit path.

With ``record_routing`` (routing replay, R3) every forward's experts are kept per request: the prompt's
from its prefill, then one row per fed token from the decode step that fed it, each under the weights of
its step, so a response continued across an update carries the routing of every segment (not only the
last one's, verl #5344) — what the engine actually ran, which is what the trainer must replay.

Text prompts only (the multimodal forward re-reads the whole sequence, uncached); stop strings, top and
prompt log-probs stay with the batch path (``TorchEngine.generate``): asked here, they are refused with a
message saying so.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from relax_core.models import MASKED_LOGIT
from relax_rollout.engines.base import GenerateOutput, SamplingParams, TokenDelta
from relax_rollout.engines.torch_engine import sample_tokens


class StepEngine(Protocol):
    """What the batcher needs of its engine (:class:`~relax_rollout.engines.torch_engine.TorchEngine`
    has it): the model's cached forward and the step lock, the token ids it treats specially, the
    weights' version and their update, and — when asked for — routing replay and constrained decoding."""

    device: Any
    pad_token_id: int
    eos_token_ids: list[int]
    masked_token_ids: list[int]
    weight_version: int
    routing: Any
    """Routing replay's recorder (:func:`relax_core.routing.install_routing`), or None."""

    @property
    def guide(self) -> Any: ...

    def step(self, what: str = ...) -> contextlib.AbstractContextManager[None]: ...

    def forward_cached(self, step_ids, mask, step_pos, cache, ids) -> tuple[torch.Tensor, Any]: ...

    def update_weights(self, tensors: dict[str, Any], version: int) -> None: ...


@dataclass
class _Seq:
    """One running request: its prompt, what it generated so far, and where it stands."""

    prompt: list[int]
    params: SamplingParams
    min_new: int
    future: Future
    gen: torch.Generator
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed: list[Any] = field(default_factory=list)
    """With routing recorded: numpy [tokens, MoE layers, k] blocks, the prefill's then one per decode step."""
    finish: str | None = None
    on_token: Callable[[TokenDelta], None] | None = None
    """Streaming: called with each new token (as a :class:`TokenDelta` numbered ``index``)."""
    index: int = 0
    guided: Any = None
    """With ``params.constraint``: its matcher (:class:`~relax_rollout.engines.constrained.GuidedRow`)."""


class ContinuousBatcher:
    """Runs ``engine``'s model over a changing set of requests on a background thread. :meth:`submit` one
    prompt (a future of its :class:`GenerateOutput`), or :meth:`generate` a list (request ``i`` seeded
    ``params.seed + i``). At most ``max_running`` sequences decode together; more wait their turn."""

    def __init__(self, engine: StepEngine, max_running: int = 64) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be at least 1, got {max_running}")
        self.engine, self.max_running = engine, max_running
        self._cond = threading.Condition()
        self._waiting: deque[_Seq] = deque()
        self._updates: list[tuple[dict[str, Any], int, Future, bool]] = []
        self._running: list[_Seq] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # [running, cached length]: 0 on each row's left pads
        self._closed = False
        self.steps = 0
        """Decode steps run so far (prefills not counted)."""
        self.peak_running = 0
        self._thread = threading.Thread(target=self._loop, name="continuous-batcher", daemon=True)
        self._thread.start()

    # -- requests -------------------------------------------------------------------------------
    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        on_token: Callable[[TokenDelta], None] | None = None,
        index: int = 0,
    ) -> Future:
        """Queue one prompt; the future resolves to its output (or the error that ended it). ``on_token``
        (streaming) is called from the batcher's thread, engine lock held, with each token as it is sampled
        (a :class:`TokenDelta` numbered ``index``): keep it quick."""
        _check_params(params)
        if not prompt:
            raise ValueError("an empty prompt: give at least one token id")
        mins = params.min_new_tokens
        if isinstance(mins, list):
            raise ValueError("submit takes one min_new_tokens per request (an int), not a list")
        gen = torch.Generator(device=self.engine.device)
        gen.manual_seed(params.seed) if params.seed is not None else gen.seed()
        seq = _Seq(list(prompt), params, int(mins), Future(), gen, on_token=on_token, index=index)
        if params.constraint is not None:  # (compiled here: a bad spec is the caller's error, not the loop's)
            seq.guided = self.engine.guide.row(params.constraint, params.stop_token_ids)
        with self._cond:
            if self._closed:
                raise RuntimeError("the continuous batcher is closed")
            self._waiting.append(seq)
            self._cond.notify_all()
        return seq.future

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        on_token: Callable[[TokenDelta], None] | None = None,
    ) -> list[GenerateOutput]:
        """Every prompt as its own request (``min_new_tokens`` may be a list, one per prompt); their
        outputs in order. ``on_token``: see :meth:`submit` (deltas numbered by prompt)."""
        mins = params.min_new_tokens
        futures = []
        for i, prompt in enumerate(prompts):
            seed = None if params.seed is None else params.seed + i
            m = mins[i] if isinstance(mins, list) else mins
            futures.append(self.submit(prompt, replace(params, seed=seed, min_new_tokens=m), on_token, i))
        return [f.result() for f in futures]

    def update_weights(
        self, tensors: dict[str, Any], version: int, drain: bool = False, timeout_s: float = 300.0
    ) -> None:
        """Load new weights between two decode steps; returns once they are in. The running requests go on
        under them (their tokens from here carry ``version``) — or, with ``drain``, the update waits until
        the running requests end, and no waiting one starts meanwhile (every response of one version)."""
        done: Future = Future()
        with self._cond:
            if self._closed or not self._thread.is_alive():
                done.set_result(None)
            else:
                self._updates.append((tensors, version, done, drain))
                self._cond.notify_all()
        if done.done():
            self.engine.update_weights(tensors, version)
            return
        try:
            done.result(timeout_s)
        except TimeoutError as e:
            raise TimeoutError(
                f"weights of version {version} were not loaded within {timeout_s:.0f} s: the batcher's "
                "loop is stuck in a step (see the engine's log)"
            ) from e

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the loop; requests not finished end with an error saying so."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        for tensors, version, done, _ in self._updates:  # (taken after the loop's last turn)
            if not done.done():
                try:
                    self.engine.update_weights(tensors, version)
                    done.set_result(None)
                except BaseException as e:  # noqa: BLE001 - the caller's to see
                    done.set_exception(e)
        self._updates = []
        left = [*self._waiting, *self._running]
        self._waiting.clear()
        self._running = []
        for seq in left:
            if not seq.future.done():
                seq.future.set_exception(RuntimeError("the continuous batcher was closed before it finished"))

    # -- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._waiting and not self._running and not self._updates:
                    self._cond.wait(1.0)
                if self._closed:
                    return
                updates = []  # in order; a draining one (and all after it) waits for the running to end
                while self._updates and not (self._updates[0][3] and self._running):
                    updates.append(self._updates.pop(0))
                hold = bool(self._updates)
            for tensors, version, done, _ in updates:  # between two steps: the running go on under them
                try:
                    self.engine.update_weights(tensors, version)
                    done.set_result(None)
                except BaseException as e:  # noqa: BLE001 - the caller's to see; the old weights stay
                    done.set_exception(e)
            with self._cond:
                room = 0 if hold else self.max_running - len(self._running)
                joining = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
            try:
                with self.engine.step("generating"):  # released between steps: a weight update goes in there
                    if joining:
                        self._prefill(joining)
                    elif self._running:
                        self._decode()
                    self.peak_running = max(self.peak_running, len(self._running))
                    finished = self._leave()
            except BaseException as e:  # noqa: BLE001 - every request in flight gets the error
                failed, self._running, self._cache, self._mask = [*joining, *self._running], [], None, None
                for seq in failed:
                    if not seq.future.done():
                        seq.future.set_exception(e)
                continue
            for seq in finished:
                seq.future.set_result(self._output(seq))

    @torch.no_grad()
    def _prefill(self, joining: list[_Seq]) -> None:
        """The newcomers' prompts through the model on rows of their own (left-padded), their first token
        sampled; then their cache rows join the running ones."""
        eng = self.engine
        width = max(len(s.prompt) for s in joining)
        ids = torch.full((len(joining), width), eng.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(joining), width), dtype=torch.long)
        for i, s in enumerate(joining):
            ids[i, width - len(s.prompt) :] = torch.tensor(s.prompt, dtype=torch.long)
            mask[i, width - len(s.prompt) :] = 1
        ids, mask = ids.to(eng.device), mask.to(eng.device)
        from transformers import DynamicCache

        with self._recording() as rec:
            logits, cache = eng.forward_cached(
                ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), DynamicCache(), ids
            )
        if rec is not None:  # [rows × width, layers, k]: each prompt's own positions (not its left pads)
            flat = rec.stacked(0).cpu()
            experts = flat.view(len(joining), width, *flat.shape[1:]).numpy()
            for i, s in enumerate(joining):
                s.routed.append(experts[i, width - len(s.prompt) :])
        self._sample(joining, logits[:, -1, :].float())
        _emit(joining)
        self._join(joining, cache, mask)

    @torch.no_grad()
    def _decode(self) -> None:
        """One decode step for every running sequence."""
        eng = self.engine
        last = torch.tensor([[s.tokens[-1]] for s in self._running], dtype=torch.long, device=eng.device)
        pos = torch.tensor(
            [[len(s.prompt) + len(s.tokens) - 1] for s in self._running], dtype=torch.long, device=eng.device
        )
        assert self._mask is not None
        self._mask = torch.cat([self._mask, torch.ones_like(self._mask[:, :1])], dim=1)
        with self._recording() as rec:
            logits, self._cache = eng.forward_cached(last, self._mask, pos, self._cache, last)
        if rec is not None:  # [rows, layers, k]: the token each row fed
            experts = rec.stacked(0).cpu().numpy()
            for i, s in enumerate(self._running):
                s.routed.append(experts[i : i + 1])
        self.steps += 1
        self._sample(self._running, logits[:, -1, :].float())
        _emit(self._running)

    @contextlib.contextmanager
    def _recording(self):
        """The experts of the forward run inside (routing replay), or None when the engine records none."""
        routing = self.engine.routing
        if routing is None:
            yield None
            return
        with routing.record() as rec:
            yield rec

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        """Each sequence's next token from its own generator, as the batch path samples one prompt alone
        (the engine's masked tokens, end tokens blocked before ``min_new_tokens``, temperature, top-p).
        The tokens and log-probs are read back once for all rows (one device sync a step, not two a row)."""
        eng = self.engine
        if eng.masked_token_ids:
            logits[:, eng.masked_token_ids] = MASKED_LOGIT
        version = eng.weight_version
        if any(s.guided is not None for s in seqs):  # constrained decoding: one mask for all rows
            eng.guide.mask_logits(logits, [s.guided for s in seqs])
        picked, lps = [], []
        for i, s in enumerate(seqs):
            row = logits[i : i + 1]
            ends = [*eng.eos_token_ids, *s.params.stop_token_ids]
            if len(s.tokens) < s.min_new and ends and not (s.guided is not None and s.guided.complete):
                row = row.clone()
                row[:, ends] = float("-inf")
            nxt, logprobs = sample_tokens(row, s.params, s.gen)
            picked.append(nxt)
            lps.append(logprobs[0, nxt])
        tokens, log_probs = torch.cat(picked).tolist(), torch.cat(lps).tolist()
        for s, token, lp in zip(seqs, tokens, log_probs):
            ends = [*eng.eos_token_ids, *s.params.stop_token_ids]
            s.tokens.append(token)
            s.log_probs.append(lp)
            s.versions.append(version)
            if s.guided is not None:
                s.guided.advance(token)
            if token in ends:
                s.finish = "stop"
            elif len(s.tokens) >= s.params.max_new_tokens:
                s.finish = "stop" if s.guided is not None and s.guided.complete else "length"

    def _join(self, joining: list[_Seq], cache: Any, mask: torch.Tensor) -> None:
        """Append the newcomers' cache rows to the running ones, padding the shorter on the left."""
        if not self._running:
            self._running, self._cache, self._mask = list(joining), cache, mask
            return
        assert self._mask is not None
        width = max(self._mask.shape[1], mask.shape[1])
        old, new = _pad_left(self._cache, self._mask, width), _pad_left(cache, mask, width)
        for lo, ln in zip(self._cache.layers, cache.layers):
            lo.keys = torch.cat([lo.keys, ln.keys], dim=0)
            lo.values = torch.cat([lo.values, ln.values], dim=0)
        self._mask = torch.cat([old, new], dim=0)
        self._running.extend(joining)

    def _leave(self) -> list[_Seq]:
        """Take the finished sequences out (their cache rows too); trim columns no row uses any more."""
        done = [s for s in self._running if s.finish is not None]
        if not done:
            return []
        keep = [i for i, s in enumerate(self._running) if s.finish is None]
        self._running = [self._running[i] for i in keep]
        if not keep:
            self._cache, self._mask = None, None
            return done
        assert self._mask is not None
        idx = torch.tensor(keep, dtype=torch.long, device=self._mask.device)
        self._mask = self._mask[idx]
        first = int(self._mask.any(dim=0).nonzero()[0])  # columns left of it are padding in every row
        for layer in self._cache.layers:
            layer.keys = layer.keys[idx, :, first:]
            layer.values = layer.values[idx, :, first:]
        self._mask = self._mask[:, first:]
        return done

    @staticmethod
    def _output(seq: _Seq) -> GenerateOutput:
        extra = {}
        if seq.routed:  # [prompt + generated - 1, layers, k]: the last sampled token was never fed
            import numpy as np

            extra["routed_experts"] = np.concatenate(seq.routed)
        return GenerateOutput(
            token_ids=list(seq.tokens),
            log_probs=list(seq.log_probs),
            finish_reason=seq.finish or "abort",
            weight_version=seq.versions[-1] if seq.versions else 0,
            token_versions=list(seq.versions),
            extra=extra,
        )


def _emit(seqs: list[_Seq]) -> None:
    """Streaming: each sequence's token just sampled to its ``on_token``."""
    for s in seqs:
        if s.on_token is not None:
            s.on_token(TokenDelta(s.index, len(s.tokens) - 1, (s.tokens[-1],), (s.log_probs[-1],)))


def _pad_left(cache: Any, mask: torch.Tensor, width: int) -> torch.Tensor:
    """Pad ``cache``'s rows (in place) and ``mask`` on the left to ``width`` cached positions; returns the
    padded mask (zeros on the new columns: attention never reads them)."""
    extra = width - mask.shape[1]
    if extra <= 0:
        return mask
    for layer in cache.layers:
        layer.keys = torch.nn.functional.pad(layer.keys, (0, 0, extra, 0))
        layer.values = torch.nn.functional.pad(layer.values, (0, 0, extra, 0))
    return torch.nn.functional.pad(mask, (extra, 0))


def _check_params(p: SamplingParams) -> None:
    unsupported = [
        name
        for name, on in (
            ("stop (strings)", bool(p.stop)),
            ("top_logprobs", bool(p.top_logprobs)),
            ("input_logprobs", bool(p.input_logprobs)),
        )
        if on
    ]
    if unsupported:
        raise ValueError(
            f"continuous batching does not serve {', '.join(unsupported)}: use the torch engine's batch "
            "generate for such requests"
        )
    if p.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1 here, got {p.max_new_tokens}")
