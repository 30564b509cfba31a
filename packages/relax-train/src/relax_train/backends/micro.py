"""How one optimizer step's samples split into forward passes (micro-batches), shared by every backend.

By count (``--micro-batch-size``, in sample order) or, with ``--use-dynamic-batch-size``, by padded tokens:
samples sorted longest first and packed while rows × longest row stays within ``--max-tokens-per-gpu``. A
micro-batch pads every row to its longest, so grouping similar lengths removes padding, and a budget in
tokens lets short samples share one larger pass (fewer kernel launches and Python steps per sample). The
losses are normalised by the whole optimizer batch's counts, so the split changes only the order of a sum.
"""

from __future__ import annotations

from collections.abc import Sequence

from relax_core import sample
from relax_core.config_sections import TrainConfig
from relax_core.sample import TrainBatch


def plan_micro_batches(lengths: Sequence[int], idx: list[int], train: TrainConfig) -> list[list[int]]:
    """The micro-batches (lists of sample indices from ``idx``) of one pass over ``idx``; ``lengths[i]`` is
    sample i's token count (prompt + response)."""
    if not train.use_dynamic_batch_size:
        mbs = train.micro_batch_size
        return [idx[m : m + mbs] for m in range(0, len(idx), mbs)]
    budget = train.max_tokens_per_gpu or 0
    out: list[list[int]] = []
    for i in sorted(idx, key=lambda i: -lengths[i]):  # stable: equal lengths keep their order
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= budget:
            out[-1].append(i)  # (the first row of a micro-batch is its longest)
        else:
            out.append([i])
    return out


def sample_lengths(samples: TrainBatch) -> list[int]:
    """Token count of each sample of a bus column dict."""
    return [len(t) for t in samples[sample.TOKENS]]
