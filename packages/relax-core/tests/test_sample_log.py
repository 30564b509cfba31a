"""The samples each trained step leaves for `relax ui` (``samples/step_<k>.jsonl``)."""

import json

import numpy as np

from relax_core import sample
from relax_core.sample_log import SampleLog, lines, logged_steps, read_step


def _batch(groups: int = 3, n: int = 2) -> dict:
    k = groups * n
    return {
        sample.TOKENS: [np.arange(5 + i % 2) for i in range(k)],
        sample.PROMPT_LEN: [3] * k,
        sample.LOSS_MASK: [np.ones(2 + i % 2, np.float32) for i in range(k)],
        sample.ROLLOUT_LOG_PROBS: [np.full(2 + i % 2, -0.123456, np.float32) for i in range(k)],
        sample.TOKEN_VERSIONS: [np.asarray([4, 5, 5][: 2 + i % 2], np.int32) for i in range(k)],
        sample.GROUP_ID: [f"7:{i // n}" for i in range(k)],
        sample.REWARD: [float(i) for i in range(k)],
        sample.POLICY_VERSION: [np.int64(4)] * k,
        sample.PROMPT_ID: [str(i // n) for i in range(k)],
    }


def test_lines_keep_whole_groups_first_with_every_per_token_array():
    d = _batch()
    got = lines(d, limit=5)  # two whole groups (4 samples); a third would pass the limit
    assert [r[sample.GROUP_ID] for r in got] == ["7:0", "7:0", "7:1", "7:1"]
    first = got[1]
    assert first["prompt_ids"] == [0, 1, 2] and first["response_ids"] == [3, 4, 5]
    assert first[sample.TOKEN_VERSIONS] == [4, 5, 5] and first[sample.ROLLOUT_LOG_PROBS] == [-0.1235] * 3
    assert first[sample.POLICY_VERSION] == 4 and isinstance(first[sample.POLICY_VERSION], int)
    assert sample.LOG_PROBS not in first  # (not in the batch: not written)
    assert len(lines(d, limit=1)) == 1  # (a first group larger than the limit is cut)
    json.dumps(got)  # (plain JSON: numpy values converted)


def test_steps_are_written_in_the_background_and_read_back(tmp_path):
    log = SampleLog(tmp_path, per_step=4)
    for step in (1, 2):
        log.write(step, _batch())
    log.close()
    assert logged_steps(tmp_path) == [1, 2]
    assert len(read_step(tmp_path, 2)) == 4
    with (tmp_path / "samples" / "step_2.jsonl").open("a") as f:
        f.write('{"cut by a cra')  # (a line a crash cut: left out)
    assert len(read_step(tmp_path, 2)) == 4
    SampleLog(tmp_path / "none", per_step=0).write(1, _batch())
    assert logged_steps(tmp_path / "none") == []
