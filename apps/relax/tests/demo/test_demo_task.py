import json

import pytest

from relax_app.demo.task import make_arithmetic_task, read_jsonl, split_pairs


def _pair(row):
    a, b = row["prompt"].rstrip("=").split("+")
    return frozenset((int(a), int(b)))


def test_held_out_pairs_never_appear_in_train_in_any_order(tmp_path):
    files = make_arithmetic_task(tmp_path, seed=3, max_operand=99, n_eval=500)
    train, held = read_jsonl(files.train_path), read_jsonl(files.eval_path)
    assert len(held) == 500
    held_pairs = {_pair(r) for r in held}
    assert len(held_pairs) == 500
    assert not held_pairs & {_pair(r) for r in train}
    # train holds every other ordered problem: 100*100 minus both orders of each held pair
    n_sym = sum(1 for p in held_pairs if len(p) == 1)
    assert len(train) == 100 * 100 - 2 * 500 + n_sym


def test_rows_are_plain_prompt_label_jsonl(tmp_path):
    files = make_arithmetic_task(tmp_path, max_operand=9, n_eval=5)
    line = files.train_path.read_text().splitlines()[0]
    row = json.loads(line)
    assert set(row) == {"prompt", "label", "id"}
    a, b = row["prompt"].rstrip("=").split("+")
    assert row["prompt"].endswith("=") and row["label"] == str(int(a) + int(b))


def test_split_is_deterministic_given_seed():
    assert split_pairs(20, 30, seed=1) == split_pairs(20, 30, seed=1)
    assert split_pairs(20, 30, seed=1) != split_pairs(20, 30, seed=2)


def test_bad_n_eval_says_what_to_fix():
    with pytest.raises(ValueError, match="n_eval must be"):
        split_pairs(3, 100, seed=0)
