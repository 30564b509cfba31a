"""A corpus of bad inputs (generated here) through `relax train` as a user runs it: each ends before
anything heavy starts (no Ray, no model loading) with exit code 2 and one line naming the flag, the file
and what to do — never a traceback. Rows that are bad inside a good file are skipped, and said so."""

from __future__ import annotations

import json

import pytest

from relax_app.cli import main
from relax_testing import build_tiny_checkpoint

pytestmark = pytest.mark.shared_ray  # (tests/conftest.py: one Ray cluster for the runs)

MODES = {"colocate": [], "fully_async": ["--fully-async"]}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("model"))


def _corpus(root):
    """name -> (flags, words the one-line error must hold)."""
    good = root / "good.jsonl"
    good.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    latin = root / "latin1.jsonl"
    latin.write_bytes('{"prompt": "café=", "label": "1"}\n'.encode("latin-1"))
    (root / "empty.jsonl").write_text("")
    (root / "blank.jsonl").write_text("\n   \n")
    (root / "notes.txt").write_text("1+1=\n")
    (root / "array.json").write_text('[{"prompt": "1+1=", "label": "2"}, {"prompt": ')
    (root / "corrupt.parquet").write_bytes(b"PAR1 this is not parquet PAR1")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["1+1="] * 50, "label": ["2"] * 50}), root / "whole.parquet")
    whole = (root / "whole.parquet").read_bytes()
    (root / "truncated.parquet").write_bytes(whole[: len(whole) // 2])
    pq.write_table(pa.table({"prompt": [1, 2], "label": ["2", "3"]}), root / "typed.parquet")
    (root / "bad.yaml").write_text("lr: 1e-6\nrollout_batch_size: [2\n")
    (root / "latin.yaml").write_bytes("output_dir: caf\xe9\n".encode("latin-1"))
    return {
        "non-UTF-8": (["--prompt-data", str(latin)], ["latin1.jsonl:1: not UTF-8", "re-encode"]),
        "empty": (["--prompt-data", str(root / "empty.jsonl")], ["no usable rows", "file is empty"]),
        "blank": (["--prompt-data", str(root / "blank.jsonl")], ["no usable rows", "file is empty"]),
        ".txt": (
            ["--prompt-data", str(root / "notes.txt")],
            ["unsupported format '.txt'", ".jsonl, .json, .parquet"],
        ),
        "torn JSON array": (["--prompt-data", str(root / "array.json")], ["not a valid JSON array"]),
        "directory": (["--prompt-data", str(root)], ["is a directory"]),
        "missing": (["--prompt-data", str(root / "absent.jsonl")], ["absent.jsonl: file not found"]),
        "corrupt parquet": (
            ["--prompt-data", str(root / "corrupt.parquet")],
            ["not a readable parquet file"],
        ),
        "truncated parquet": (
            ["--prompt-data", str(root / "truncated.parquet")],
            ["not a readable parquet file"],
        ),
        "wrongly typed parquet": (
            ["--prompt-data", str(root / "typed.parquet")],
            ["no usable rows", "--input-key column 'prompt' holds int: give text or a list of chat messages"],
        ),
        "bad eval data": (
            ["--prompt-data", str(good), "--eval-data", str(root / "empty.jsonl")],
            ["--eval-data", "no usable rows"],
        ),
        "YAML syntax": (
            [str(root / "bad.yaml"), "--prompt-data", str(good)],
            ["bad.yaml: not valid YAML", "line 2"],
        ),
        "YAML not UTF-8": ([str(root / "latin.yaml"), "--prompt-data", str(good)], ["latin.yaml: not UTF-8"]),
        "blank elastic token": (
            ["--prompt-data", str(good), "--elastic-token", " "],
            ["--elastic-token must be a non-blank token"],
        ),
        "no model": (
            ["--prompt-data", str(good), "--hf-checkpoint", str(root / "nowhere")],
            ["--hf-checkpoint", "config.json missing"],
        ),
    }


@pytest.mark.parametrize("mode", MODES)
def test_each_bad_input_is_one_clear_line_and_exit_2_before_anything_starts(model, tmp_path, capsys, mode):
    for name, (flags, words) in _corpus(tmp_path).items():
        own_model = "--hf-checkpoint" in flags
        argv = ["train", *flags, *([] if own_model else ["--hf-checkpoint", model])]
        code = main([*argv, *MODES[mode], "--output-dir", str(tmp_path / "out")])
        err = capsys.readouterr().err.strip()
        assert code == 2, (name, err)
        assert len(err.splitlines()) == 1 and err.startswith("relax: ") and "Traceback" not in err, (
            name,
            err,
        )
        for w in words:
            assert w in err, (name, w, err)


def test_bad_rows_inside_a_good_file_are_said_before_the_run(model, tmp_path, capsys):
    from relax_app.cli_config import build_config
    from relax_app.train import check_inputs

    data = tmp_path / "data.jsonl"
    data.write_bytes(
        b'{"prompt": "<image>1+1=", "label": "2"}\n{"prompt": "x\xff", "label": "1"}\nnot json\n'
    )
    flags = ["--prompt-data", str(data), "--hf-checkpoint", model, "--rollout-max-response-len", "8"]
    skipped, media = check_inputs(build_config(None, flags))
    assert skipped.startswith(f"--prompt-data {data}: 2 of 3 rows skipped (first: {data}:2: not UTF-8")
    # each row that cannot be decoded is skipped and counted with its line, the file's other rows kept
    # (before: a line nested 100k deep was a RecursionError that killed the run, a 5,000-digit label
    # rejected the whole file naming neither file nor line, a blank prompt was trained)
    deep = "[" * 100_000 + "]" * 100_000
    data.write_text(
        "\n".join(
            [
                '{"prompt": "1+1=", "label": "2"}',
                f'{{"prompt": "2+2=", "label": {deep}}}',
                '{"prompt": "3+3=", "label": ' + "9" * 5000 + "}",
                '{"prompt": "   ", "label": "1"}',
            ]
        )
        + "\n"
    )
    from relax_core.data import load_prompts

    ds = load_prompts(data)
    assert [r.prompt for r in ds.rows] == ["1+1="]
    assert ds.skipped == [
        f"{data}:2: JSON nested too deeply to read; fix or remove the line",
        f"{data}:3: unreadable JSON (Exceeds the limit (4300 digits) for integer string conversion: value has "
        "5000 digits; use sys.set_int_max_str_digits() to increase the limit); fix or remove the line",
        f"{data} row 3: empty or blank --input-key column 'prompt'",
    ]
    # a prompt marking an image in a text-only run trained as text, without a word
    assert "1 prompts mark media" in media and "--multimodal-keys" in media
