"""Prompt loading (jsonl / parquet / the datasets library's files; text or chat messages; bad rows skipped and
named) and the resumable PromptIterator."""

import json

import pytest

from relax_core.data import PromptIterator, PromptRow, load_prompts


def _rows(n):
    return [PromptRow(prompt=f"p{i}", label=str(i), metadata={}, row_id=str(i)) for i in range(n)]


def test_jsonl_loads_prompt_label_metadata_and_id(write_jsonl):
    path = write_jsonl(
        [
            {"prompt": "1+1=", "label": "2", "meta": {"rm_type": "math"}, "id": "a"},
            {"prompt": "2+2=", "label": 4},
        ]
    )
    ds = load_prompts(path, metadata_key="meta")
    assert ds.skipped == []
    assert [(r.prompt, r.label, r.metadata, r.row_id) for r in ds.rows] == [
        ("1+1=", "2", {"rm_type": "math"}, "a"),
        ("2+2=", 4, {}, "1"),
    ]


def test_custom_keys(write_jsonl):
    path = write_jsonl([{"question": "3+4=", "answer": "7"}])
    ds = load_prompts(path, input_key="question", label_key="answer")
    assert (ds.rows[0].prompt, ds.rows[0].label) == ("3+4=", "7")


def test_blank_lines_ignored(write_jsonl):
    path = write_jsonl([{"prompt": "a", "label": 1}, "", "   ", {"prompt": "b", "label": 2}])
    ds = load_prompts(path)
    assert [r.prompt for r in ds.rows] == ["a", "b"]
    assert ds.skipped == []


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"prompt": ["1+2=", "", "5+5="], "label": ["3", "0", "10"]})
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    ds = load_prompts(path)
    assert [(r.prompt, r.label) for r in ds.rows] == [("1+2=", "3"), ("5+5=", "10")]
    assert [r.row_id for r in ds.rows] == ["0", "2"]
    assert len(ds.skipped) == 1
    assert str(path) in ds.skipped[0] and "row 1" in ds.skipped[0]


def test_bad_rows_skipped_counted_and_named(write_jsonl):
    path = write_jsonl(
        [
            {"prompt": "ok1", "label": "1"},
            "{not json",
            {"label": "2"},
            {"prompt": "no label"},
            {"prompt": "", "label": "3"},
            "[1, 2]",
            {"prompt": "bad meta", "label": "4", "meta": "oops"},
            {"prompt": "ok2", "label": "5"},
        ]
    )
    ds = load_prompts(path, metadata_key="meta")
    assert [r.prompt for r in ds.rows] == ["ok1", "ok2"]
    assert len(ds.skipped) == 6
    for msg in ds.skipped:
        assert str(path) in msg
    assert ":2:" in ds.skipped[0] and "JSON" in ds.skipped[0]  # line number of the bad line
    assert "row 2" in ds.skipped[1] and "'prompt'" in ds.skipped[1]
    assert "row 3" in ds.skipped[2] and "'label'" in ds.skipped[2]
    assert "row 4" in ds.skipped[3]
    assert "row 5" in ds.skipped[4] and "list" in ds.skipped[4]
    assert "row 6" in ds.skipped[5] and "'meta'" in ds.skipped[5]


def test_no_usable_rows_is_a_clear_error(write_jsonl):
    path = write_jsonl([{"label": "1"}, "nope"])
    with pytest.raises(ValueError, match="no usable rows") as exc:
        load_prompts(path)
    assert str(path) in str(exc.value) and "2 skipped" in str(exc.value)


def test_empty_file_is_a_clear_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(ValueError, match="no usable rows"):
        load_prompts(path)


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(FileNotFoundError, match="--prompt-data"):
        load_prompts(tmp_path / "absent.jsonl")
    csv = tmp_path / "data.csv"
    csv.write_text("prompt,label\n")
    with pytest.raises(ValueError, match="unsupported format"):
        load_prompts(csv)


def test_encodings_bom_and_json_arrays(tmp_path):
    """A non-UTF-8 byte stopped the run with a UnicodeDecodeError naming neither file nor line; a BOM lost
    the first row; a .json file holding one array was read line by line (every line invalid)."""
    bad = tmp_path / "mixed.jsonl"
    bad.write_bytes(b'{"prompt": "1+1=", "label": "2"}\n{"prompt": "caf\xe9", "label": "x"}\n')
    ds = load_prompts(bad)
    assert [r.prompt for r in ds.rows] == ["1+1="]
    assert ds.skipped == [f"{bad}:2: not UTF-8 (byte 0xe9 at column 16); re-encode the file as UTF-8"]
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes('{"prompt": "café", "label": "é"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"no usable rows .*latin1.jsonl:1: not UTF-8"):
        load_prompts(latin)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "label": "1"}\n{"prompt": "b", "label": "2"}\n')
    assert [r.prompt for r in load_prompts(bom).rows] == ["a", "b"]
    array = tmp_path / "rows.json"
    array.write_text('[\n {"prompt": "a", "label": "1"},\n {"prompt": "b", "label": "2"}\n]\n')
    assert [r.prompt for r in load_prompts(array).rows] == ["a", "b"]


def test_paths_that_are_not_data_files_say_so(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        load_prompts(tmp_path)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    with pytest.raises(ValueError, match="no usable rows .*file is empty"):
        load_prompts(blank)
    torn = tmp_path / "torn.parquet"
    torn.write_bytes(b"PAR1" + b"\0" * 40)
    with pytest.raises(ValueError, match=r"torn.parquet: not a readable parquet file"):
        load_prompts(torn)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize(("n", "batch"), [(10, 3), (6, 2), (5, 5), (4, 7)])
def test_every_row_once_per_epoch(n, batch, shuffle):
    it = PromptIterator(_rows(n), batch_size=batch, shuffle=shuffle, seed=1)
    seen = [r.row_id for _ in range(n * 3) for r in it.next_batch()]  # n*3*batch draws
    for epoch in range(batch * 3):
        chunk = seen[epoch * n : (epoch + 1) * n]
        assert sorted(chunk, key=int) == [str(i) for i in range(n)], f"epoch {epoch}"
    if not shuffle:
        assert seen[:n] == [str(i) for i in range(n)]


def test_batches_have_batch_size():
    it = PromptIterator(_rows(5), batch_size=3, seed=0)
    assert all(len(it.next_batch()) == 3 for _ in range(6))


def test_deterministic_per_seed_and_epochs_differ():
    def order(seed, k=40):
        it = PromptIterator(_rows(20), batch_size=4, seed=seed)
        return [r.row_id for _ in range(k // 4) for r in it.next_batch()]

    assert order(3) == order(3)
    assert order(3) != order(4)
    first = order(3)
    assert first[:20] != first[20:]  # reshuffled each epoch
    assert first[:20] != [str(i) for i in range(20)]


@pytest.mark.parametrize("consumed", [0, 1, 2, 4, 5, 9])
def test_state_dict_resumes_exactly(consumed):
    rows = _rows(7)
    ref = PromptIterator(rows, batch_size=3, seed=5)
    for _ in range(consumed):
        ref.next_batch()
    state = ref.state_dict()
    expected = [[r.row_id for r in ref.next_batch()] for _ in range(6)]

    resumed = PromptIterator(rows, batch_size=3, seed=5)
    resumed.load_state_dict(dict(state))
    got = [[r.row_id for r in resumed.next_batch()] for _ in range(6)]
    assert got == expected


# -- datasets as veRL and slime users bring them (#50) ----------------------------------------------------
# veRL's documented row: examples/data_preprocess/gsm8k.py of volcengine/verl writes this layout to parquet
# (a chat-message prompt, the label at reward_model.ground_truth, extra_info); trained with
# --input-key prompt --label-key reward_model.ground_truth --metadata-key extra_info.
VERL_ROW = {
    "data_source": "openai/gsm8k",
    "prompt": [
        {
            "role": "user",
            "content": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
            "in May. How many clips did Natalia sell altogether in April and May? Let's think step by step "
            'and output the final answer after "####".',
        }
    ],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "72"},
    "extra_info": {"split": "train", "index": 0, "answer": "48/2 = 24 ... #### 72", "question": "Natalia..."},
}
# slime's: the dapo-math-17k jsonl its quick start trains (--input-key prompt --label-key label
# --apply-chat-template), and the `messages` layout of chat datasets with a system turn.
SLIME_ROW = {"prompt": [{"content": "Solve 1+1. Answer: $Answer", "role": "user"}], "label": "2"}
SLIME_MESSAGES_ROW = {
    "messages": [
        {"role": "system", "content": "You are a careful solver."},
        {"role": "user", "content": "What is 2+3?"},
    ],
    "label": "5",
}


def test_verl_parquet_keeps_the_messages_and_reads_the_nested_label(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([VERL_ROW, {**VERL_ROW, "reward_model": {"style": "rule"}}]), path)
    ds = load_prompts(path, "prompt", "reward_model.ground_truth", "extra_info")
    assert not ds.skipped
    assert ds.rows[0].prompt == VERL_ROW["prompt"] and ds.rows[0].label == "72"
    assert ds.rows[0].metadata["index"] == 0 and ds.rows[0].metadata["split"] == "train"
    assert ds.rows[1].label is None  # parquet gives the absent field as null: a label-free row (counted)
    # a row without the path at all: skipped, named, with the columns it has (the paths to give)
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text(
        json.dumps(VERL_ROW) + "\n" + json.dumps({**VERL_ROW, "reward_model": {"style": "rule"}})
    )
    assert load_prompts(jsonl, "prompt", "reward_model.ground_truth").skipped == [
        f"{jsonl} row 1: missing --label-key column 'reward_model.ground_truth' (the row has: data_source, "
        "prompt, ability, reward_model.{style}, extra_info.{split, index, answer, question})"
    ]


def test_slime_jsonl_of_messages_with_a_system_turn(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(f"{json.dumps(SLIME_ROW)}\n{json.dumps(SLIME_MESSAGES_ROW)}\n")
    assert [r.prompt for r in load_prompts(path, "prompt").rows] == [SLIME_ROW["prompt"]]
    (row,) = load_prompts(path, "messages").rows
    assert [m["role"] for m in row.prompt] == ["system", "user"] and row.label == "5"


def test_a_column_whose_name_holds_the_dot_wins_over_the_path(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "p", "a.b": "flat", "a": {"b": "nested"}}) + "\n")
    assert load_prompts(path, "prompt", "a.b").rows[0].label == "flat"


def test_content_parts_become_text_with_media_markers(tmp_path):
    parts = [
        {"type": "text", "text": "What is in "},
        {"type": "image_url", "image_url": {"url": "file:///data/cat.png"}},
        {"type": "text", "text": " and "},
        {"type": "image", "image": "dog.png"},
        {"type": "text", "text": "?"},
    ]
    path = tmp_path / "mm.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": parts}], "label": "x"}) + "\n")
    (row,) = load_prompts(path, media_keys={"image": "images"}).rows
    assert row.prompt == [{"role": "user", "content": "What is in <image> and <image>?"}]
    assert row.media == {"images": ["file:///data/cat.png", "dog.png"]}
    # a run that reads no images cannot use the row: skipped, saying what to add
    with pytest.raises(
        ValueError, match=r"holds image parts, and the run reads no image: add --multimodal-keys"
    ):
        load_prompts(path)


@pytest.mark.parametrize(
    "messages, problem",
    [
        ([{"content": "hi"}], "message 0: role None is not one of system, user, assistant, tool"),
        ([{"role": "user", "content": 3}], "message 0: content must be text or a list of parts, got int"),
        (["hi"], "message 0: expected an object with role and content, got str"),
        ([{"role": "user", "content": ""}], "no message has any content"),
        ([{"role": "user", "content": [{"type": "file", "file": "x"}]}], "content part of type 'file'"),
        ([{"role": "user", "content": [{"type": "image"}]}], "a image part without its 'image' value"),
    ],
)
def test_a_malformed_message_skips_its_row_naming_the_message(tmp_path, messages, problem):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": messages, "label": "1"}) + "\n" + json.dumps(SLIME_ROW) + "\n")
    ds = load_prompts(path, media_keys={"image": "images"})
    assert len(ds.rows) == 1 and len(ds.skipped) == 1
    assert ds.skipped[0].startswith(f"{path} row 0: ") and problem in ds.skipped[0]


def test_the_datasets_librarys_folder_and_arrow_file(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(
        [VERL_ROW, {**VERL_ROW, "reward_model": {"style": "rule", "ground_truth": "1"}}]
    )
    ds.save_to_disk(str(tmp_path / "saved"))
    got = load_prompts(tmp_path / "saved", label_key="reward_model.ground_truth")
    assert [r.label for r in got.rows] == ["72", "1"] and got.rows[0].prompt == VERL_ROW["prompt"]
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dict"))
    assert len(load_prompts(tmp_path / "dict", label_key="reward_model.ground_truth").rows) == 2
    (arrow,) = (tmp_path / "saved").glob("*.arrow")
    assert len(load_prompts(arrow, label_key="reward_model.ground_truth").rows) == 2
