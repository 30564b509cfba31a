"""Prompt loading (jsonl / parquet, bad rows skipped and named) and the resumable PromptIterator."""

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
