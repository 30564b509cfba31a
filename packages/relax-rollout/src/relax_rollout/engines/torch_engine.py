"""A batched sampling engine on plain torch + an HF causal LM, with a KV cache.

Why our own loop instead of ``model.generate``: we need the log-prob of every sampled token under the
exact distribution sampled from, per-prompt minimum lengths, a weight version, and in-place weight
updates between batches — and the positions must match the trainer's recomputation bit for bit, so we
control padding (left) and ``position_ids`` ourselves.

Top log-probs (``SamplingParams.top_logprobs``) come from the same log-probs as the sampled token's, as in
SGLang's sampler: ``log_softmax(logits / T)`` (after the temperature, before top-p), ``log_softmax(logits)``
when greedy. Stop strings (``SamplingParams.stop``) are checked after every decode step on the tail of each
sequence, so a stopped sequence costs no further steps (SGLang's ``check_finished``, one token a step).
Prompt log-probs (``SamplingParams.input_logprobs``, SGLang's ``logprob_start_len``) come from the prefill's
logits, untempered, as SGLang's input log-probs: no extra forward (with ``max_new_tokens`` 0, the prefill
alone runs).
LoRA (``lora=``, a run's ``relax_core.lora.peft_config_dict``): the model carries peft's adapters (B = 0: the
base until the first update), served merged into the weights (generation costs the base model's), and weight
updates are adapter updates in the wire format of :mod:`relax_core.lora`, loaded whole under the engine lock.
Constrained decoding (``SamplingParams.constraint``) masks the logits before sampling, per sequence, with
:mod:`relax_rollout.engines.constrained` (llguidance); the log-probs are then the masked distribution's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from relax_core.models import MASKED_LOGIT, forward_takes, media_token_ids
from relax_core.offload import HostOffload
from relax_rollout.engines.base import GenerateOutput, MemoryReleased, SamplingParams, TokenDelta, memory_tags
from relax_rollout.engines.decode_rows import DecodeRows, left_padded
from relax_rollout.engines.pauses import WeightPauses


class TorchEngine:
    def __init__(
        self,
        model_path: str | None = None,
        model: torch.nn.Module | None = None,
        eos_token_ids: list[int] | None = None,
        pad_token_id: int | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        max_batch_size: int = 512,
        record_routing: bool = False,
        tokenizer: Any = None,
        lora: dict[str, Any] | None = None,
        compile: bool = False,
    ) -> None:
        """``tokenizer`` decodes for stop strings; by default the one saved with ``model_path``, loaded at
        the first request with stop strings. ``lora``: serve base + adapter (the trainer's
        ``peft_config_dict``); updates then carry the adapter's tensors only. ``compile``: the cached
        (decode) forward through torch.compile (``--torch-compile``; :class:`relax_core.compiled.Compiled`)."""
        if model is None:
            if model_path is None:
                raise ValueError("TorchEngine needs model_path or model")
            from relax_core.models import load_model

            model = load_model(model_path, dtype)
        self.lora = lora
        if lora is not None:
            from relax_core.lora import wrap

            model = wrap(model, lora)
        self.model = model.to(device).eval()
        self.adapter: Any = None
        """With ``lora``: the adapter served merged into the weights (:class:`relax_core.lora.MergedServing`)."""
        if lora is not None:
            from relax_core.lora import MergedServing

            self.adapter = MergedServing(self.model)
        from relax_core.compiled import Compiled

        self._decode_forward = Compiled(self.model, "the torch engine's forward", compile)
        self.model_path, self._tokenizer = model_path, tokenizer
        self._guide: Any = None  # constrained decoding's view of the tokenizer, built at first use
        cfg: Any = self.model.config  # an HF config (nn.Module types an attribute as Tensor | Module)
        eos = eos_token_ids if eos_token_ids is not None else cfg.eos_token_id
        self.eos_token_ids: list[int] = [eos] if isinstance(eos, int) else list(eos or [])
        self.pad_token_id: int = pad_token_id if pad_token_id is not None else (cfg.pad_token_id or 0)
        self.device = device
        self.max_batch_size = max_batch_size
        self.weight_version = 0
        self._lock = threading.Lock()
        self.pauses = WeightPauses()
        """How long each weight update held generation (:mod:`relax_rollout.engines.pauses`)."""
        self._host = HostOffload("rollout engine")
        self.released: set[str] = set()
        """Memory tags given back (:meth:`release_memory`); generation waits for :meth:`resume_memory`."""
        self.masked_token_ids = media_token_ids(self.model)  # never sampled (the trainer masks them too)
        self.takes_token_types = forward_takes(self.model, "mm_token_type_ids")
        self.routing = None  # routing replay (R3): record each token's MoE experts, extra["routed_experts"]
        if record_routing:
            from relax_core.routing import install_routing

            self.routing = install_routing(self.model)  # None for a dense model: nothing to record

    @property
    def features(self) -> frozenset[str]:
        """:data:`~relax_rollout.engines.base.OPTIONAL_FEATURES` served: stop strings and constraints need a
        tokenizer."""
        text = self._tokenizer is not None or self.model_path is not None
        return frozenset(
            {"top_logprobs", "input_logprobs", "stream", *(("stop", "constraint") if text else ())}
        )

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            if self.model_path is None:
                raise ValueError("stop strings need a tokenizer: build the TorchEngine with tokenizer=")
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._tokenizer

    @property
    def guide(self) -> Any:
        """The constrained-decoding :class:`~relax_rollout.engines.constrained.Guide` of this engine's
        tokenizer and vocabulary (built at the first constrained request)."""
        if self._guide is None:
            from relax_rollout.engines.constrained import Guide

            lm: Any = self.model  # an HF causal LM: nn.Module types its methods as Tensor | Module
            vocab = lm.get_output_embeddings().weight.shape[0]
            self._guide = Guide(self.tokenizer, vocab, self.eos_token_ids)
        return self._guide

    # -- weights -------------------------------------------------------------------------------
    def update_weights(self, tensors: dict[str, Any], version: int) -> None:
        """Copy ``tensors`` (HF names) into the model; called between generation batches. MoE experts may come
        fused, as the model holds them, or one per expert, as checkpoints and SGLang name them. With ``lora``:
        the adapter's tensors (wire format), every one of them (unknown or missing names are refused before
        anything is copied)."""
        from relax_rollout.engines.expert_names import fuse_experts

        with self._lock, self.pauses.timed(version), torch.no_grad():  # (no step runs while it is held)
            self._check_weights("updating the weights")
            if self.adapter is not None:
                self.adapter.load({n: torch.as_tensor(v) for n, v in tensors.items()})
                self.weight_version = version
                return
            params = dict(self.model.named_parameters())
            params.update(dict(self.model.named_buffers()))
            tensors = fuse_experts(tensors, params)
            missing = [n for n in tensors if n not in params]
            if missing:
                raise KeyError(f"weight update names unknown to the engine: {missing[:5]}")
            for name, value in tensors.items():
                params[name].copy_(torch.as_tensor(value))
            self.weight_version = version

    def named_weights(self):
        """The weights an update writes (what a weights checksum covers): the adapter's (wire format) with
        ``lora``, else every parameter under its HF name."""
        if self.lora is not None:
            from relax_core.lora import adapter_state

            return list(adapter_state(self.model).items())
        return list(self.model.named_parameters())

    # -- device memory (colocate) ----------------------------------------------------------------
    def release_memory(self, tags: list[str] | None = None) -> None:
        """Give the device memory of ``tags`` back (SGLang's ``/release_memory_occupation``): the weights
        go to host memory (kept, so :meth:`resume_memory` alone restores them); this engine's KV cache
        and graphs live only inside a generate call, so those tags free nothing more."""
        tags = memory_tags(tags)
        with self._lock:
            if "weights" in tags and not self._host.offloaded:
                self._host.offload(self.model.parameters())
            self.released.update(tags)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Take back the memory of ``tags`` (all by default); the engine generates again once nothing is
        released."""
        tags = memory_tags(tags)
        with self._lock:
            if "weights" in tags:
                self._host.onload()
            self.released.difference_update(tags)

    def weights_checksum(self) -> str:
        from relax_core.dcs import checksum

        self._check_weights("a weights checksum")
        return checksum(self.named_weights())

    def _check_weights(self, what: str) -> None:
        if self._host.offloaded:
            raise MemoryReleased(
                f"the engine's weights are released: resume_memory(['weights']) before {what}"
            )

    @contextlib.contextmanager
    def step(self, what: str = "generating") -> Iterator[None]:
        """Hold the engine for one step of a caller's own decode loop (the continuous batcher's): no
        weight update or memory release runs inside, and the weights must be on the device (else
        :class:`MemoryReleased` naming ``what``). Release it between steps so updates can go in."""
        with self._lock:
            self._check_weights(what)
            yield

    # -- generation ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        on_step: Callable[[int], set[int] | None] | None = None,
        mm: list[dict[str, Any] | None] | None = None,
        on_token: Callable[[TokenDelta], None] | None = None,
    ) -> list[GenerateOutput]:
        """Sample a response per prompt.

        ``mm`` (multimodal models): per prompt, its media tensors and ``mm_token_type_ids`` (None for a
        text-only prompt), as the rollout worker got them from relax-multimodal; the prompt's ids already
        hold the expanded placeholders.

        ``on_step(t)`` (optional, used by the HTTP server for pause/abort) runs before every decode step
        with the engine lock released — it may block (an in-place pause) while weights are updated — and
        returns the indices (into ``prompts``) to abort now; those end with finish_reason "abort" and
        keep the tokens generated so far.

        ``on_token`` (token-by-token streaming) is called after every decode step, from this thread, with
        one :class:`~relax_rollout.engines.base.TokenDelta` per response still generating (its new token)."""
        if not prompts:
            return []
        if self.released:
            raise MemoryReleased(
                f"the engine's memory is released ({sorted(self.released)}): resume_memory() (or POST "
                "/resume_memory_occupation) before generating"
            )
        out: list[GenerateOutput] = []
        min_new = params.min_new_tokens
        for start in range(0, len(prompts), self.max_batch_size):
            chunk = prompts[start : start + self.max_batch_size]
            mins = (
                min_new[start : start + len(chunk)] if isinstance(min_new, list) else [min_new] * len(chunk)
            )
            hook = None
            if on_step is not None:
                hook = self._chunk_hook(on_step, start, len(chunk))
            chunk_mm = mm[start : start + len(chunk)] if mm is not None and any(mm) else None
            emit = None if on_token is None else _Emitter(on_token, start)
            with self._lock:
                out.extend(self._generate_chunk(chunk, params, mins, hook, chunk_mm, emit))
        return out

    def _chunk_hook(self, on_step: Callable[[int], set[int] | None], start: int, n: int):
        def hook(t: int) -> list[int]:
            self._lock.release()  # let a weight update in while the caller pauses
            try:
                rows = on_step(t) or set()
            finally:
                self._lock.acquire()
            return [i - start for i in rows if start <= i < start + n]

        return hook

    @torch.no_grad()
    def _generate_chunk(
        self, prompts: list[list[int]], p: SamplingParams, mins: list[int], hook=None, mm=None, emit=None
    ) -> list[GenerateOutput]:
        if self.routing is not None and mm is not None:
            raise ValueError(
                "record_routing (--routing-replay) is not supported for multimodal prompts: the uncached "
                "multimodal forward re-reads the whole sequence every step"
            )
        bsz = len(prompts)
        ids, mask, positions = left_padded(prompts, self.pad_token_id, self.device)
        gen = torch.Generator(device=self.device)
        if p.seed is not None:
            gen.manual_seed(p.seed)
        else:
            gen.seed()
        eos = torch.tensor(self.eos_token_ids + list(p.stop_token_ids), dtype=torch.long, device=self.device)
        min_t = torch.tensor(mins, dtype=torch.long, device=self.device)
        rows = DecodeRows.empty(bsz, p.max_new_tokens, p.top_logprobs, self.device)
        stops = _StopStrings(self.tokenizer, p.stop) if p.stop else None
        guided = [self.guide.row(p.constraint, p.stop_token_ids) for _ in prompts] if p.constraint else None

        from transformers import DynamicCache

        cache = DynamicCache()
        step_ids, step_pos = ids, positions
        forward = self.forward_cached if mm is None else self._mm_forward(mm, [len(x) for x in prompts])
        rec = None
        if self.routing is not None:
            forward, rec = self._recorded(forward)
        prompt_lps = None
        if p.input_logprobs and p.max_new_tokens == 0:  # nothing to generate: the prefill alone
            prompt_lps = self._prompt_logprobs(
                forward(ids, mask, positions, cache, ids)[0], prompts, rows.top_k
            )
        versions: list[int] = []  # per decode step, the weights' version (an in-place pause may change it)
        for t in range(p.max_new_tokens):
            if hook is not None and (aborted := hook(t)):
                rows.abort(t, aborted)
                if bool(rows.done.all()):
                    break
            versions.append(self.weight_version)
            full, cache = forward(step_ids, mask, step_pos, cache, ids)
            if t == 0 and p.input_logprobs:
                prompt_lps = self._prompt_logprobs(full, prompts, rows.top_k)
            live = None if guided is None else [None if d else g for g, d in zip(guided, rows.done.tolist())]
            logits = self._allowed_logits(full[:, -1, :].float(), t, min_t, eos, live)
            nxt, logprobs = sample_tokens(logits, p, gen)
            lp = logprobs.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
            nxt = torch.where(rows.done, torch.full_like(nxt, self.pad_token_id), nxt)
            rows.record(t, nxt, lp, logprobs)
            if emit is not None:  # (before this step's stops: the token that stops a row is sent too)
                k = rows.k
                top = (rows.top_ids[:, t, :k], rows.top_lp[:, t, :k]) if rows.top_k else ()
                emit(t, nxt, lp, rows.done, *top)
            if live is not None:
                for g, token in zip(live, nxt.tolist()):
                    if g is not None:
                        g.advance(token)
            hit = torch.isin(nxt, eos) & ~rows.done
            if stops is not None:  # a stop string wins over a stop token completing it, as in SGLang
                for i, s in stops.check(rows.tokens[:, : t + 1], rows.done).items():
                    rows.matched[i] = s
                    hit[i] = True
            rows.stop(t, hit)
            if bool(rows.done.all()):
                break
            step_ids = nxt.unsqueeze(1)
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((bsz, 1), dtype=mask.dtype, device=self.device)], dim=1)
            if mm is not None:  # the uncached multimodal forward re-reads the whole sequence
                ids = torch.cat([ids, step_ids], dim=1)

        routed = self._routed_experts(rec, prompts, rows.lengths.tolist()) if rec is not None else None
        if guided is not None:  # a match completed on the last token allowed: a stop, not a cut
            rows.stopped |= torch.tensor([g.complete for g in guided], device=self.device) & ~rows.aborted
        return rows.outputs(self.weight_version, versions, routed, prompt_lps)

    def _allowed_logits(
        self, logits: torch.Tensor, t: int, min_t: torch.Tensor, eos: torch.Tensor, live: list | None
    ) -> torch.Tensor:
        """Step ``t``'s logits with what may not come next masked: the model's masked tokens, stop tokens
        before a row's minimum length, and (``live``: each running row's grammar) what its grammar forbids."""
        if self.masked_token_ids:
            logits[:, self.masked_token_ids] = MASKED_LOGIT
        if t < int(min_t.max()):
            block = (min_t > t).unsqueeze(1) & torch.isin(
                torch.arange(logits.shape[-1], device=self.device), eos
            ).unsqueeze(0)
            logits = logits.masked_fill(block, float("-inf"))
        if live is not None:  # (after the EOS block: a complete match's EOS goes through)
            self.guide.mask_logits(logits, live)
        return logits

    @staticmethod
    def _prompt_logprobs(
        logits: torch.Tensor, prompts: list[list[int]], top_k: int
    ) -> list[tuple[list[float | None], list[list[tuple[int, float]] | None] | None]]:
        """Per prompt, from the prefill's logits ``[bsz, width, vocab]`` of the left-padded prompts: each
        token's log-prob given the tokens before it (the first None), and with ``top_k`` each position's k
        most likely ``(token_id, log-prob)`` (the first None). Untempered: SGLang's input log-probs are the
        ``log_softmax`` of the raw logits."""
        width, out = logits.shape[1], []
        for i, x in enumerate(prompts):
            # row j predicts token j + 1
            lp = torch.log_softmax(logits[i, width - len(x) : -1].float(), dim=-1)
            nxt = torch.tensor(x[1:], dtype=torch.long, device=lp.device)
            vals: list[float | None] = [None, *lp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1).tolist()]
            top = None
            if top_k:
                v, idx = lp.topk(min(top_k, lp.shape[-1]), dim=-1)
                v = v.clamp(min=torch.finfo(v.dtype).min)
                top = [None, *(list(zip(r, q)) for r, q in zip(idx.tolist(), v.tolist()))]
            out.append((vals, top))
        return out

    def _recorded(self, forward):
        """``forward`` recording the experts of each call (in call order) into the returned Recording."""
        routing = self.routing
        assert routing is not None, "recorded only with record_routing on a MoE model"
        rec = routing.new_recording()

        def recorded(*args):
            with routing.record(into=rec):
                return forward(*args)

        return recorded, rec

    def _routed_experts(self, rec, prompts: list[list[int]], lengths: list[int]) -> list:
        """Per sample, numpy [len(prompt) + n_generated - 1, n_moe_layers, k]: the experts of every token of
        the sample that went through the model (prompt tokens from the prefill, then each fed generated
        token; the last sampled token is never fed). Pad positions and the steps a finished row still ran
        are dropped; entries never recorded (an abort before the prefill) are -1."""
        import numpy as np

        assert self.routing is not None, "recorded only with record_routing on a MoE model"
        bsz, width = len(prompts), max(len(x) for x in prompts)
        layers, k = self.routing.num_layers, self.routing.top_k
        fwd = [rec.stacked(f).cpu() for f in range(len(rec.forwards))]
        prefill = fwd[0].view(bsz, width, layers, k) if fwd else None
        steps = torch.stack([f.view(bsz, layers, k) for f in fwd[1:]], dim=1) if len(fwd) > 1 else None
        out = []
        for i, (x, n) in enumerate(zip(prompts, lengths)):
            total = max(len(x) + n - 1, 0)
            arr = np.full((total, layers, k), -1, dtype=np.int16 if rec.dtype == torch.int16 else np.int32)
            if prefill is not None:
                m = min(len(x), total)
                arr[:m] = prefill[i, width - len(x) : width - len(x) + m].numpy()
            fed = total - len(x)  # generated tokens fed back: step t (t >= 1) feeds token t - 1
            if steps is not None and fed > 0:
                arr[len(x) :] = steps[i, :fed].numpy()
            out.append(arr)
        return out

    def forward_cached(self, step_ids, mask, step_pos, cache, ids):
        """Text models: only the new tokens go through, with a KV cache and explicit positions. Returns every
        position's logits (the prefill's give the prompt log-probs) and the cache. ``ids`` (the whole
        sequence) is unused here; it keeps the signature of the multimodal forward. Call it inside
        :meth:`step` (or a ``generate``), never beside a weight update."""
        out = self._decode_forward(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=step_pos,
            past_key_values=cache,
            use_cache=True,
        )
        return out.logits, out.past_key_values

    def _mm_forward(self, mm: list[dict[str, Any] | None], prompt_lens: list[int]):
        """Multimodal models: the whole sequence (media included) goes through at every step, without a
        cache. Why: the model then derives its M-RoPE positions from the media grids exactly as in the
        trainer's single forward over the same sequence; the tiny CPU models make the recomputation cheap.
        (SGLang does the cached version on GPUs.)"""
        from relax_core.mm import collate_mm, token_types

        media = {k: v.to(self.device) for k, v in collate_mm(mm).items()}
        width = max(prompt_lens)
        types = None
        if self.takes_token_types:
            types = token_types(mm, prompt_lens, width, left=True).to(self.device)  # prompts are left-padded

        def forward(step_ids, mask, step_pos, cache, ids):
            extra = dict(media)
            if types is not None:
                grown = ids.shape[1] - width  # generated tokens so far: text
                extra["mm_token_type_ids"] = torch.nn.functional.pad(types, (0, grown))
            out = self.model(input_ids=ids, attention_mask=mask, use_cache=False, **extra)
            return out.logits, None

        return forward


def sample_tokens(
    logits: torch.Tensor, p: SamplingParams, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled tokens of ``logits`` ``[rows, vocab]`` under ``p`` (greedy, or temperature then top-p,
    drawn from ``gen``), and the log-probs of every token under the distribution sampled from. Shared by
    the batch path and the continuous batcher, so a request samples alike on both."""
    if p.greedy:
        return logits.argmax(-1), torch.log_softmax(logits, dim=-1)
    scaled = logits / p.temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    probs = logprobs.exp()
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < p.top_p
        filtered = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
        probs = filtered / filtered.sum(-1, keepdim=True)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1), logprobs


class _Emitter:
    """A decode step's new tokens as :class:`TokenDelta` s for ``on_token`` (streaming): one per row still
    generating, numbered in the whole ``generate`` call (``offset``: the chunk's first prompt)."""

    def __init__(self, on_token: Callable[[TokenDelta], None], offset: int) -> None:
        self.on_token, self.offset = on_token, offset

    def __call__(self, t: int, nxt, lp, done, top_ids=None, top_lp=None) -> None:
        rows = (~done).nonzero().flatten().tolist()
        tokens, lps = nxt.tolist(), lp.tolist()
        tops = None
        if top_ids is not None:
            tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_lp.tolist())]
        for r in rows:
            top = (tuple(tops[r]),) if tops is not None else None
            self.on_token(TokenDelta(self.offset + r, t, (tokens[r],), (lps[r],), top))


class _StopStrings:
    """Which sequences' decoded tails now contain a stop string. Only the last ``4 * len(longest) + 4``
    tokens are decoded each step (a character is at most 4 byte tokens; the margin keeps a string off the
    window's first token, whose leading space some tokenizers drop): a string completed by the newest token
    lies within them, and an earlier one would have stopped the sequence earlier. Decoded with special
    tokens, as SGLang matches them (``stop="<|im_end|>"`` works)."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]):
        self.tokenizer, self.stops = tokenizer, stops
        self.window = 4 * max(len(s) for s in stops) + 4

    def check(self, tokens: torch.Tensor, done: torch.Tensor) -> dict[int, str]:
        """{row: the stop string its tail now contains} for the rows not ``done``."""
        tails = tokens[:, -self.window :].tolist()
        hits = {}
        for i in (~done).nonzero().flatten().tolist():
            text = self.tokenizer.decode(tails[i])
            s = next((s for s in self.stops if s in text), None)
            if s is not None:
                hits[i] = s
        return hits
