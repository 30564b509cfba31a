"""The sample schema (``samples.py``) for responses that went on across weight updates (partial rollout):
the staleness version is the oldest token's, the per-token versions travel with the sample, and
--mask-offpolicy-in-partial-rollout keeps only the last version's tokens in the loss."""

import numpy as np
import pytest

from relax_app.cli_config import build_config
from relax_core.data import PromptRow
from relax_rewards import RewardResult
from relax_rollout.engines.base import GenerateOutput
from relax_rollout.generation import Generated
from relax_rollout.samples import SampleWriter

FLAGS = ["--prompt-data", "p.jsonl", "--hf-checkpoint", "m", "--fully-async", "--streaming-rollout"]


def _samples(*flags: str) -> list[dict]:
    cfg = build_config(None, [*FLAGS, *flags, "--n-samples-per-prompt", "2"])
    outs = [
        GenerateOutput([5, 6, 7, 8, 9], [-0.1] * 5, "stop", 4, token_versions=[3, 3, 4, 4, 4]),
        GenerateOutput([5, 6], [-0.2] * 2, "stop", 4, token_versions=[4, 4]),
    ]
    gen = Generated(7, [PromptRow("q", "a", {}, row_id="r1")], [[1, 2]] * 2, outs, 0.1, 7, first_group=3)
    gen.texts = ["x", "y"]
    writer = SampleWriter(cfg, None, None, None, None, journaled=False)
    return writer.samples(gen, [RewardResult(1.0), RewardResult(0.0)])


def test_a_continued_response_is_as_stale_as_its_oldest_token_and_carries_every_tokens_version():
    first, second = _samples("--partial-rollout")
    assert first["policy_version"] == 3 and second["policy_version"] == 4
    assert first["token_versions"].tolist() == [3, 3, 4, 4, 4] and first["token_versions"].dtype == np.int32
    assert first["loss_mask"].tolist() == [1.0] * 5  # (no masking unless asked)
    assert first["group_id"] == second["group_id"] == "7:3"  # the step's fourth group


def test_masking_off_policy_tokens_keeps_the_last_versions_tokens_only():
    first, second = _samples("--partial-rollout", "--mask-offpolicy-in-partial-rollout")
    assert first["loss_mask"].tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert second["loss_mask"].tolist() == [1.0, 1.0]


def test_the_mask_needs_partial_rollout():
    with pytest.raises(Exception, match="add it"):
        build_config(None, [*FLAGS, "--mask-offpolicy-in-partial-rollout"])
