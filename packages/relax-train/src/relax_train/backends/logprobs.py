"""Response-token log-probs from a model's logits, the one computation both backends share.

Why apart: the torch backend (an HF model's logits) and the megatron backend (a megatron model's, gathered
over tensor- and context-parallel ranks) must score a token alike, or their losses differ; each calls these
plain functions and a :class:`TokenScorer` on the logits it has, instead of one backend inheriting the
other's methods. Rows are right-padded prompt+response sequences; scores are at the rollout temperature
with the tokens the rollout engine never samples masked, so they match the rollout engine's log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from relax_core.models import MASKED_LOGIT
from relax_core.sample import PROMPT_LEN, TOKENS, TrainBatch
from relax_train.algorithms.losses import entropy_from_logits


def pad_rows(
    samples: TrainBatch, idx: list[int], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """Samples ``idx`` as right-padded rows: (token ids [B, S], attention mask [B, S], prompt lengths,
    response lengths)."""
    seqs = [np.asarray(samples[TOKENS][i]) for i in idx]
    plens = [int(samples[PROMPT_LEN][i]) for i in idx]
    rlens = [len(s) - p for s, p in zip(seqs, plens)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.from_numpy(s.astype(np.int64))
        mask[row, : len(s)] = 1
    return ids, mask, plens, rlens


def response_positions(plens: list[int], rlens: list[int], width: int, dev):
    """Row and column indices [B, Rmax] of the positions that predict each response token (right-padded
    rows of ``width``), and which of them are real tokens."""
    steps = torch.arange(max(rlens), device=dev)
    rows = torch.arange(len(rlens), device=dev).unsqueeze(1)
    cols = (torch.tensor(plens, device=dev).unsqueeze(1) - 1 + steps).clamp(max=width - 2)
    valid = steps.unsqueeze(0) < torch.tensor(rlens, device=dev).unsqueeze(1)
    return rows, cols, valid


def padded_field(values: list, idx: list[int], width: int) -> torch.Tensor:
    """A per-token field (advantages, masks, log-probs) of samples ``idx`` as [B, width] float32, zero-padded."""
    out = torch.zeros((len(idx), width), dtype=torch.float32)
    for row, i in enumerate(idx):
        v = torch.tensor(np.asarray(values[i], dtype=np.float32))[:width]
        out[row, : len(v)] = v
    return out


@dataclass(frozen=True)
class TokenScorer:
    """Log-probs of tokens under logits, as the rollout engine samples them: at ``temperature``, with
    ``masked_token_ids`` (media placeholders) never possible."""

    temperature: float
    masked_token_ids: list[int] = field(default_factory=list)

    def token_logp(self, logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool = False):
        """Logits [..., V] -> log-prob of ``targets`` [...] at the rollout temperature (and entropies)."""
        logits = logits.float()
        if self.masked_token_ids:  # the rollout engine never samples these: same distribution here
            logits[..., self.masked_token_ids] = MASKED_LOGIT
        logits = logits / self.temperature
        logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return logp, entropy_from_logits(logits) if with_entropy else None

    def response_logp(self, logits, ids, plens, rlens, with_entropy: bool = False):
        """[B, S, V] logits of right-padded prompt+response rows -> ([B, Rmax] response-token log-probs,
        validity mask, response lengths, entropies or None)."""
        rows, cols, valid = response_positions(plens, rlens, ids.shape[1], logits.device)
        targets = ids.to(logits.device)[rows, cols + 1]
        logp, ent = self.token_logp(logits[rows, cols], targets, with_entropy)  # over [B, Rmax, V]
        return logp, valid, rlens, ent

    def response_logp_from_hidden(self, hidden, weight, ids, plens, rlens, chunk: int, with_entropy=False):
        """[B, S, H] last hidden states and the LM head's ``weight`` [V, H] -> what :meth:`response_logp`
        gives, scored ``chunk`` tokens at a time without the [B, S, V] logits
        (:func:`~relax_train.backends.chunked_logprobs.chunked_token_logp`)."""
        from relax_train.backends.chunked_logprobs import chunked_token_logp

        rows, cols, valid = response_positions(plens, rlens, ids.shape[1], hidden.device)
        targets = ids.to(hidden.device)[rows, cols + 1]
        logp, ent = chunked_token_logp(
            hidden[rows, cols], weight, targets, self.temperature, self.masked_token_ids, chunk, with_entropy
        )
        return logp, valid, rlens, ent
