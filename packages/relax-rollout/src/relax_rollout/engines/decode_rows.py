"""What the torch engine's decode loop writes per row, and the replies made of it.

Kept apart from :class:`~relax_rollout.engines.torch_engine.TorchEngine`'s loop so that the loop reads as
the steps of decoding (forward, shape the logits, sample, stop) and the buffers, their bookkeeping and the
:class:`~relax_rollout.engines.base.GenerateOutput` of each row are one object's job.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relax_rollout.engines.base import GenerateOutput


def left_padded(
    prompts: list[list[int]], pad_token_id: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts as left-padded rows (ids, attention mask, positions): every row's next token is the last
    column, which is what a batched decode step appends to."""
    bsz, width = len(prompts), max(len(x) for x in prompts)
    ids = torch.full((bsz, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((bsz, width), dtype=torch.long)
    for i, x in enumerate(prompts):
        ids[i, width - len(x) :] = torch.tensor(x, dtype=torch.long)
        mask[i, width - len(x) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@dataclass
class DecodeRows:
    """Per row of a decode batch: the tokens and log-probs sampled, the top log-probs asked for, and how
    the row ended (``lengths``; ``stopped`` by a stop token or string, ``aborted``, else the length cap)."""

    tokens: torch.Tensor
    logps: torch.Tensor
    top_lp: torch.Tensor
    top_ids: torch.Tensor
    done: torch.Tensor
    lengths: torch.Tensor
    stopped: torch.Tensor
    aborted: torch.Tensor
    matched: list[str | None]
    top_k: int
    k: int

    @classmethod
    def empty(cls, bsz: int, max_new_tokens: int, top_k: int, device: torch.device | str) -> DecodeRows:
        steps = (bsz, max_new_tokens)
        return cls(
            tokens=torch.zeros(steps, dtype=torch.long, device=device),
            logps=torch.zeros(steps, dtype=torch.float32, device=device),
            top_lp=torch.zeros((*steps, top_k), dtype=torch.float32, device=device),
            top_ids=torch.zeros((*steps, top_k), dtype=torch.long, device=device),
            done=torch.zeros(bsz, dtype=torch.bool, device=device),
            lengths=torch.full((bsz,), max_new_tokens, dtype=torch.long, device=device),
            stopped=torch.zeros(bsz, dtype=torch.bool, device=device),
            aborted=torch.zeros(bsz, dtype=torch.bool, device=device),
            matched=[None] * bsz,
            top_k=top_k,
            k=top_k,
        )

    def abort(self, t: int, rows: list[int]) -> None:
        """End ``rows`` (those still running) at step ``t``, as aborted."""
        hit = torch.zeros_like(self.done)
        hit[rows] = True
        hit &= ~self.done
        self.lengths = torch.where(hit, torch.full_like(self.lengths, t), self.lengths)
        self.aborted |= hit
        self.done |= hit

    def record(self, t: int, nxt: torch.Tensor, lp: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Step ``t``'s tokens and log-probs (zero for finished rows) and, when asked, the top ones."""
        self.tokens[:, t] = nxt
        self.logps[:, t] = torch.where(self.done, torch.zeros_like(lp), lp)
        if self.top_k:
            self.k = min(self.top_k, logprobs.shape[-1])  # (a vocabulary smaller than k: all of it)
            vals, idx = logprobs.topk(self.k, dim=-1)  # (-inf, e.g. masked tokens, clamped as SGLang does)
            self.top_lp[:, t, : self.k] = vals.clamp(min=torch.finfo(vals.dtype).min)
            self.top_ids[:, t, : self.k] = idx

    def stop(self, t: int, hit: torch.Tensor) -> None:
        """Rows ``hit`` stopped after step ``t``'s token."""
        self.lengths = torch.where(hit, torch.full_like(self.lengths, t + 1), self.lengths)
        self.stopped |= hit
        self.done |= hit

    def outputs(
        self,
        weight_version: int,
        versions: list[int],
        routed: list | None,
        prompt_lps: list | None,
    ) -> list[GenerateOutput]:
        """One reply per row: its tokens up to where it ended, with what was recorded for them."""
        results = []
        k = self.k
        for i in range(len(self.matched)):
            n = int(self.lengths[i])
            top = None
            if self.top_k:
                rows = zip(self.top_ids[i, :n, :k].tolist(), self.top_lp[i, :n, :k].tolist())
                top = [list(zip(row_ids, row_lps)) for row_ids, row_lps in rows]
            reason = "abort" if bool(self.aborted[i]) else "stop" if bool(self.stopped[i]) else "length"
            results.append(
                GenerateOutput(
                    token_ids=self.tokens[i, :n].tolist(),
                    log_probs=self.logps[i, :n].tolist(),
                    finish_reason=reason,
                    weight_version=weight_version,
                    extra={"routed_experts": routed[i]} if routed is not None else {},
                    top_logprobs=top,
                    matched_stop=self.matched[i],
                    input_logprobs=prompt_lps[i][0] if prompt_lps is not None else None,
                    input_top_logprobs=prompt_lps[i][1] if prompt_lps is not None else None,
                    token_versions=versions[:n],
                )
            )
        return results
