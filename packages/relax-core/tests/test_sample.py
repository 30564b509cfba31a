"""The typed batch the training side reads: the bus's columns as a ``TrainBatch`` (same lists, no copy),
a missing needed column or unequal columns refused naming them, a new role's own column riding along."""

from __future__ import annotations

import numpy as np
import pytest

from relax_core import sample
from relax_core.sample import TrainBatch, columns, train_batch


def _cols(n: int = 2) -> dict[str, list]:
    return {
        sample.TOKENS: [np.arange(4) for _ in range(n)],
        sample.PROMPT_LEN: [2] * n,
        sample.LOSS_MASK: [np.ones(2, np.float32) for _ in range(n)],
    }


def test_the_bus_columns_become_the_typed_batch_without_a_copy():
    cols = {**_cols(), "n_tokens": [4, 4]}  # (a new role's own field: untyped, kept)
    batch: TrainBatch = train_batch(cols)
    assert batch is cols and batch[sample.TOKENS] is cols[sample.TOKENS]
    assert columns(batch)["n_tokens"] == [4, 4]


def test_a_batch_missing_what_the_reader_needs_is_refused_naming_it():
    cols = _cols()
    del cols[sample.PROMPT_LEN]
    with pytest.raises(ValueError, match=r"lacks the columns \['prompt_len'\]"):
        train_batch(cols)
    with pytest.raises(ValueError, match=r"lacks the columns \['advantages'\]"):
        train_batch(_cols(), need=(sample.TOKENS, sample.ADVANTAGES))


def test_columns_of_unequal_length_are_refused():
    cols = _cols()
    cols[sample.LOSS_MASK] = cols[sample.LOSS_MASK][:1]
    with pytest.raises(ValueError, match="differ in length"):
        train_batch(cols)


def test_every_schema_field_is_a_typed_column():
    assert set(TrainBatch.__annotations__) == sample.FIELDS
