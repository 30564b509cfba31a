"""The GPU recipes (apps/relax/recipes/*.yaml) and their dataset converters (`relax prepare-data`).

Recipes: each parses and validates, its GPU topology fits (TP × PP × CP divides the trainer's GPUs, EP ×
expert TP divides a pipeline stage, SGLang engines tile the rollout GPUs), its reward exists, and a broken
topology override fails naming the flag. Converters: a tiny file in each dataset's published format,
with one bad row, converts (bad row skipped and named) and `load_prompts` reads the output with the
recipe's own keys; the `relax prepare-data` command works end to end."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf
from PIL import Image

from relax_app.cli import main as relax_main
from relax_app.cli_config import ConfigError, build_config
from relax_app.recipes import FORMATS, ConversionError, convert
from relax_core.data import load_prompts
from relax_rewards import get_reward

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
EXPECTED = {  # recipe: (GPUs, nodes, reward, media modalities)
    "qwen3_4b_dapo": (8, 1, "math", set()),
    "qwen3_vl_4b_mm_r1": (8, 1, "openr1mm", {"image"}),
    "qwen3_omni_30b_avqa": (16, 2, "multiple_choice", {"image", "video", "audio"}),
}


def recipe_config(name: str, tmp_path: Path, extra: list[str] = ()):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    data = tmp_path / "data.jsonl"
    data.touch()
    return build_config(
        RECIPES / f"{name}.yaml", ["--hf-checkpoint", str(model), "--prompt-data", str(data), *extra]
    )


# -- recipes -----------------------------------------------------------------------------------------


def test_every_recipe_is_tested():
    assert {p.stem for p in RECIPES.glob("*.yaml")} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recipe_validates_with_a_gpu_topology_that_fits(name, tmp_path):
    gpus, nodes, reward, modalities = EXPECTED[name]
    cfg = recipe_config(name, tmp_path)
    t, r = cfg.train, cfg.rollout
    assert (t.train_backend, r.rollout_backend, cfg.run.mode) == ("megatron", "sglang", "colocate")
    assert (t.actor_num_nodes, t.actor_num_nodes * t.actor_num_gpus_per_node) == (nodes, gpus)
    mp = t.tensor_model_parallel_size * t.pipeline_model_parallel_size * t.context_parallel_size
    assert gpus % mp == 0
    etp = t.expert_tensor_parallel_size or t.tensor_model_parallel_size
    assert (gpus // t.pipeline_model_parallel_size) % (t.expert_model_parallel_size * etp) == 0
    assert r.rollout_num_gpus == gpus and r.rollout_num_gpus % r.rollout_num_gpus_per_engine == 0
    assert cfg.samples_per_rollout % cfg.effective_global_batch_size == 0
    assert r.rm_type == reward and callable(get_reward(reward))
    assert set(cfg.data.multimodal_keys or {}) == modalities
    assert (cfg.data.input_key, cfg.data.label_key, cfg.data.metadata_key) == ("prompt", "label", "metadata")
    assert cfg.data.apply_chat_template and cfg.model.dtype == "bfloat16"
    # the shared GRPO settings upstream Relax uses in all three scripts
    assert (cfg.algo.advantage_estimator, cfg.algo.eps_clip, cfg.algo.eps_clip_high) == ("grpo", 0.2, 0.28)
    assert (t.lr, t.weight_decay, t.adam_beta2) == (1e-6, 0.1, 0.98)
    assert cfg.algo.tis_mode == "token_truncate"


def test_recipe_specifics(tmp_path):
    dapo = recipe_config("qwen3_4b_dapo", tmp_path)
    assert dapo.rollout.dynamic_sampling and dapo.rollout.n_samples_per_prompt == 8
    assert dapo.rollout.rollout_max_response_len == 8192 and dapo.algo.kl_coef == 0.0
    assert dapo.train.tensor_model_parallel_size == 2 and dapo.rollout.sglang_mem_fraction_static == 0.8
    vl = recipe_config("qwen3_vl_4b_mm_r1", tmp_path)
    assert vl.train.context_parallel_size == 4 and vl.data.multimodal_keys == {"image": "image"}
    omni = recipe_config("qwen3_omni_30b_avqa", tmp_path)
    t = omni.train
    assert (t.tensor_model_parallel_size, t.pipeline_model_parallel_size, t.expert_model_parallel_size) == (
        4,
        2,
        8,
    )
    assert omni.algo.kl_coef == 0.001 and omni.algo.uses_reference and not omni.algo.routing_replay
    assert omni.rollout.rollout_num_gpus_per_engine == 2
    assert omni.rollout.sglang_model_path.startswith("/path/to/")  # SGLang serves the whole model
    from relax_rollout.engine_factory import sglang_kwargs

    kw = sglang_kwargs(omni)  # 8 engines of 2 GPUs: 4 on each node
    assert (kw["num_engines"], kw["tp_size"], kw["gpus_per_node"]) == (8, 2, 8)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recipe_paths_are_placeholders(name):
    """Model and data cannot ship with the recipe: they are placeholders the user overrides."""
    cfg = build_config(RECIPES / f"{name}.yaml", [])
    assert cfg.model.hf_checkpoint.startswith("/path/to/") and cfg.data.prompt_data.startswith("/path/to/")
    text = (RECIPES / f"{name}.yaml").read_text()
    assert f"uv run relax train apps/relax/recipes/{name}.yaml" in text and "--hf-checkpoint" in text


@pytest.mark.parametrize(
    "name, override, named",
    [
        ("qwen3_4b_dapo", ["--tensor-model-parallel-size", "3"], "--actor-num-gpus-per-node"),
        ("qwen3_4b_dapo", ["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size"),
        ("qwen3_vl_4b_mm_r1", ["--context-parallel-size", "8"], "TP × PP × CP"),
        ("qwen3_vl_4b_mm_r1", ["--rollout-num-gpus-per-engine", "3"], "--rollout-num-gpus-per-engine"),
        ("qwen3_omni_30b_avqa", ["--expert-model-parallel-size", "16"], "EP × expert TP (16 × 1)"),
        (
            "qwen3_omni_30b_avqa",
            ["--actor-num-nodes", "1", "--pipeline-model-parallel-size", "4"],
            "(8 GPUs)",
        ),
        ("qwen3_omni_30b_avqa", ["--actor-num-gpus-per-node", "0"], "--actor-num-gpus-per-node"),
        ("qwen3_omni_30b_avqa", ["--sglang-mem-fraction-static", "1.5"], "--sglang-mem-fraction-static"),
    ],
)
def test_broken_topology_override_fails_naming_the_flag(name, override, named, tmp_path):
    with pytest.raises(ConfigError) as err:
        recipe_config(name, tmp_path, override)
    assert named in str(err.value)


# -- converters --------------------------------------------------------------------------------------

DAPO_PROMPT = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{q}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)


def dapo_record(q: str, answer: str, index: str) -> dict:
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": DAPO_PROMPT.format(q=q), "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index},
    }


def test_dapo_math_parquet(tmp_path):
    rows = [
        dapo_record("What is 17 + 17?", "34", "a1"),
        dapo_record("What is 2^10?", "1024", "b2"),
        dapo_record("What is 17 + 17?", "34", "a1"),  # the published file repeats problems
        dapo_record("What is 0/0?", "", "c3"),  # bad: empty answer
    ]
    src = tmp_path / "dapo-math-17k.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)  # nested list<struct> / struct columns, as published
    out = tmp_path / "out" / "dapo.jsonl"
    report = convert("dapo-math", src, out)
    assert (report.rows_read, report.written, report.duplicates) == (4, 2, 1)
    assert report.skipped == [f"{src} row 3: reward_model.ground_truth: empty answer"]
    assert report.media_dir is None

    cfg = recipe_config("qwen3_4b_dapo", tmp_path, ["--prompt-data", str(out)])
    ds = load_prompts(
        out, cfg.data.input_key, cfg.data.label_key, cfg.data.metadata_key, cfg.data.multimodal_keys
    )
    assert [(r.row_id, r.label) for r in ds.rows] == [("a1", "34"), ("b2", "1024")] and not ds.skipped
    assert ds.rows[0].prompt == [{"role": "user", "content": DAPO_PROMPT.format(q="What is 17 + 17?")}]
    assert ds.rows[0].metadata == {
        "data_source": "math_dapo",
        "ability": "MATH",
        "style": "rule-lighteval/MATH_v2",
        "index": "a1",
    }
    reward = get_reward(cfg.rollout.rm_type)
    assert reward("17 + 17 = 34.\nAnswer: 34", ds.rows[0].label).score == 1.0


def test_dapo_math_jsonl_with_a_broken_line(tmp_path):
    """The pre-processed jsonl (prompt + label) slime and upstream Relax use reads too; a line that is not
    JSON is one skipped row."""
    src = tmp_path / "dapo-math-17k.jsonl"
    turns = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "1+1? Answer: $Answer"}]
    good = {"prompt": turns, "label": "2"}
    src.write_text(json.dumps(good) + "\n{not json\n" + json.dumps({"prompt": "3+4?", "label": 7}) + "\n")
    report = convert("dapo-math", src, tmp_path / "o.jsonl")
    assert report.written == 2 and len(report.skipped) == 1
    assert report.skipped[0].startswith(f"{src} row 1: not valid JSON")
    ds = load_prompts(tmp_path / "o.jsonl")
    # the system turn stays a system turn (it was merged into the user's text)
    assert [(r.prompt, r.label) for r in ds.rows] == [(turns, "2"), ("3+4?", "7")]


def image_bytes(colour: tuple[int, int, int], size=(24, 16), fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format=fmt)
    return buf.getvalue()


def test_openr1_mm_parquet_writes_images(tmp_path):
    hf_image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # the HF Image feature on disk
    schema = pa.schema(
        [
            ("image", hf_image),
            ("problem", pa.string()),
            ("solution", pa.string()),
            ("original_question", pa.string()),
            ("original_answer", pa.string()),
        ]
    )
    rows = [
        {
            "image": {"bytes": image_bytes((255, 0, 0)), "path": "a.png"},
            "problem": "How many red squares?",
            "solution": "<think>one</think><answer> 1 </answer>",
            "original_question": "q",
            "original_answer": "1",
        },
        {
            "image": {"bytes": image_bytes((0, 0, 255), fmt="JPEG"), "path": None},
            "problem": "Angle ABC?",
            "solution": "<answer>45</answer>",
            "original_question": "q",
            "original_answer": "45",
        },
        {
            "image": {"bytes": b"\x89PNG\r\n\x1a\n not an image", "path": "bad.png"},
            "problem": "Broken?",
            "solution": "<answer>0</answer>",
            "original_question": "q",
            "original_answer": "0",
        },
    ]
    src = tmp_path / "train-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), src)
    out = tmp_path / "train.converted.jsonl"
    report = convert("openr1-mm", src, out)
    assert (report.written, len(report.skipped)) == (2, 1)
    assert report.skipped[0].startswith(f"{src} row 2: image: bytes do not decode as an image")
    media = tmp_path / "train.converted_images"
    assert report.media_dir == str(media)
    assert sorted(p.name for p in media.iterdir()) == ["000000.png", "000001.jpg"]  # nothing for the bad row

    cfg = recipe_config("qwen3_vl_4b_mm_r1", tmp_path, ["--prompt-data", str(out)])
    ds = load_prompts(
        out, cfg.data.input_key, cfg.data.label_key, cfg.data.metadata_key, cfg.data.multimodal_keys
    )
    assert [r.label for r in ds.rows] == ["1", "45"]
    first = ds.rows[0]
    assert first.prompt.startswith("<image>How many red squares?") and "<answer>" in first.prompt
    assert first.media == {"image": [str(media / "000000.png")]}
    with Image.open(first.media["image"][0]) as im:
        assert im.size == (24, 16) and im.getpixel((0, 0)) == (255, 0, 0)
    assert first.metadata["solution"] == "<think>one</think><answer> 1 </answer>"
    reward = get_reward(cfg.rollout.rm_type)
    assert reward("<think>count</think><answer>1</answer>", first.label).score == 2.0


def write_avqa(split: Path, records: list[dict]) -> Path:
    """An AVQA_R1/<split>/ folder as published: images/, audios/ and omni_rl_format_<split>.json."""
    (split / "images").mkdir(parents=True)
    (split / "audios").mkdir()
    for k in range(2):
        Image.new("RGB", (16, 16), (40 * k, 80, 120)).save(split / "images" / f"sample_{k}.jpg")
        sf.write(split / "audios" / f"sample_{k}.wav", np.zeros(1600, dtype=np.float32), 16000)
    src = split / f"omni_rl_format_{split.name}.json"
    src.write_text(json.dumps(records, indent=2))
    return src


def avqa_record(k: int, answer: str, audio: str | None = None) -> dict:
    return {
        "problem_id": 100 + k,
        "problem": "What is making the sound?",
        "data_type": "image_audio",
        "problem_type": "multiple choice",
        "options": ["A. A dog", "B. A car engine", "C. Rain", "D. A bell"],
        "solution": f"<answer>{answer}</answer>",
        "path": {"image": f"images/sample_{k % 2}.jpg", "audio": audio or f"audios/sample_{k % 2}.wav"},
        "data_source": "OmniInstruct_v1-AVQA",
    }


@pytest.fixture
def avqa_source(tmp_path):
    records = [avqa_record(0, "B"), avqa_record(1, "D"), avqa_record(2, "A", audio="audios/missing.wav")]
    return write_avqa(tmp_path / "AVQA_R1" / "train", records)


def test_avqa_json(avqa_source, tmp_path):
    out = tmp_path / "avqa.jsonl"
    report = convert("avqa", avqa_source, out)
    assert (report.written, len(report.skipped)) == (2, 1)
    assert report.skipped[0] == (
        f"{avqa_source} row 2: path.audio: file {avqa_source.parent / 'audios/missing.wav'} not found"
    )
    cfg = recipe_config("qwen3_omni_30b_avqa", tmp_path, ["--prompt-data", str(out)])
    ds = load_prompts(
        out, cfg.data.input_key, cfg.data.label_key, cfg.data.metadata_key, cfg.data.multimodal_keys
    )
    assert [(r.row_id, r.label) for r in ds.rows] == [("100", "B"), ("101", "D")]
    row = ds.rows[0]
    assert row.prompt.startswith(
        "<image><audio>What is making the sound?\nOptions:\nA. A dog\nB. A car engine"
    )
    assert set(row.media) == {"image", "audio"}  # no video in this dataset: that key stays unused
    for paths in row.media.values():
        assert len(paths) == 1 and Path(paths[0]).is_absolute() and Path(paths[0]).is_file()
    assert row.metadata["choices"] == {"A": "A dog", "B": "A car engine", "C": "Rain", "D": "A bell"}
    assert row.metadata["problem_type"] == "multiple choice"
    reward = get_reward(cfg.rollout.rm_type)
    assert reward("<think>an engine hum</think>\nAnswer: B", row.label, row.metadata).score == 1.0
    assert reward("<think>hmm</think>\nAnswer: C", row.label, row.metadata).score == 0.0


def test_same_question_over_other_media_is_not_a_duplicate(tmp_path):
    records = [
        avqa_record(0, "B"),
        avqa_record(1, "B"),
        avqa_record(0, "B"),
    ]  # 0 and 1: same text, other files
    report = convert("avqa", write_avqa(tmp_path / "train", records), tmp_path / "o.jsonl")
    assert (report.written, report.duplicates, report.skipped) == (2, 1, [])


def test_avqa_bad_rows_are_named_never_fatal(tmp_path):
    bad = [
        {**avqa_record(0, "B"), "solution": "<answer></answer>"},
        {**avqa_record(1, "E")},
        {k: v for k, v in avqa_record(0, "A").items() if k != "problem"},
        {**avqa_record(1, "A"), "options": "A. one"},
        {**avqa_record(0, "A"), "path": None},
        "not a record",
        avqa_record(1, "C"),
    ]
    src = write_avqa(tmp_path / "valid", bad)
    report = convert("avqa", src, tmp_path / "v.jsonl")
    assert report.written == 1
    assert [m.split(": ", 1)[1] for m in report.skipped] == [
        "solution: empty answer",
        "solution: answer 'E' is not one of the options A, B, C, D",
        "problem: missing column",
        "options: missing or empty",
        "path: missing column (expected {image, audio} file paths)",
        "expected an object, got str",
    ]
    assert [m.split(": ", 1)[0] for m in report.skipped] == [f"{src} row {i}" for i in range(6)]


def test_convert_rejects_what_it_cannot_read(tmp_path):
    with pytest.raises(ConversionError, match="unknown format 'gsm8k'"):
        convert("gsm8k", tmp_path / "x.parquet", tmp_path / "y.jsonl")
    with pytest.raises(ConversionError, match="file not found"):
        convert("avqa", tmp_path / "missing.json", tmp_path / "y.jsonl")
    (tmp_path / "x.parquet").write_bytes(b"not parquet")
    with pytest.raises(ConversionError, match="not a readable parquet file"):
        convert("dapo-math", tmp_path / "x.parquet", tmp_path / "y.jsonl")
    assert not (tmp_path / "y.jsonl").exists() and not list(tmp_path.glob(".y.jsonl.*"))
    assert set(FORMATS) == {"dapo-math", "openr1-mm", "avqa"}


# -- the command -------------------------------------------------------------------------------------


def test_prepare_data_command_end_to_end(avqa_source, tmp_path, capsys):
    out = tmp_path / "converted" / "train.converted.jsonl"
    assert relax_main(["prepare-data", "avqa", str(avqa_source), str(out), "--limit", "5"]) == 0
    printed = capsys.readouterr().out
    assert f"prepare-data avqa: 2 rows written to {out} (3 read, 1 skipped)" in printed
    assert "row 2: path.audio" in printed
    cfg = build_config(
        RECIPES / "qwen3_omni_30b_avqa.yaml", ["--hf-checkpoint", str(tmp_path), "--prompt-data", str(out)]
    )
    ds = load_prompts(
        cfg.data.prompt_data,
        cfg.data.input_key,
        cfg.data.label_key,
        cfg.data.metadata_key,
        cfg.data.multimodal_keys,
    )
    assert len(ds.rows) == 2 and all(set(r.media) == {"image", "audio"} for r in ds.rows)

    assert (
        relax_main(["prepare-data", "avqa", str(avqa_source), str(tmp_path / "one.jsonl"), "--limit=1"]) == 0
    )
    assert len((tmp_path / "one.jsonl").read_text().splitlines()) == 1


def test_prepare_data_command_errors(tmp_path, capsys):
    assert relax_main(["prepare-data", "nope", "a.json", str(tmp_path / "b.jsonl")]) == 2
    assert "unknown format 'nope'" in capsys.readouterr().err
    assert relax_main(["prepare-data", "avqa", "only-two-args"]) == 2
    assert relax_main(["prepare-data", "avqa", "a", "b.jsonl", "--limit", "0"]) == 2
    assert relax_main(["prepare-data", "--help"]) == 0
    assert "dapo-math" in capsys.readouterr().out
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    assert relax_main(["prepare-data", "avqa", str(empty), str(tmp_path / "e.jsonl")]) == 1  # nothing usable
    assert relax_main(["--help"]) == 0 and "prepare-data" in capsys.readouterr().out


def test_a_recipe_path_resolves_from_an_installed_package(tmp_path, monkeypatch):
    """A launcher's ``apps/relax/recipes/X.yaml`` runs from any directory (an image's /work): the relax-app
    wheel ships the recipes, and a config file that is not there is the shipped one of its name."""
    import subprocess
    import zipfile

    from relax_app.recipes import shipped_configs

    root = Path(__file__).resolve().parents[3]
    subprocess.run(
        ["uv", "build", "--package", "relax-app", "--wheel", "--out-dir", str(tmp_path), "-q"],
        cwd=root,
        check=True,
    )
    (wheel,) = tmp_path.glob("relax_app-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for recipe in (root / "apps/relax/recipes").glob("*.yaml"):
        assert f"relax_app/recipes/configs/{recipe.name}" in names
    monkeypatch.chdir(tmp_path)
    argv = [
        "--lr",
        "1e-6",
        "apps/relax/recipes/qwen3_4b_dapo.yaml",
        "--config=x/qwen3_vl_4b_mm_r1.yaml",
        "mine.yaml",
    ]
    got = shipped_configs(argv)
    assert got[:2] == ["--lr", "1e-6"] and got[4] == "mine.yaml"  # (not a recipe's name: left to be refused)
    assert Path(got[2]).read_text() == (root / "apps/relax/recipes/qwen3_4b_dapo.yaml").read_text()
    assert got[3].startswith("--config=") and got[3].endswith("qwen3_vl_4b_mm_r1.yaml")
    (tmp_path / "apps/relax/recipes").mkdir(parents=True)
    (tmp_path / "apps/relax/recipes/qwen3_4b_dapo.yaml").write_text("lr: 1\n")
    assert shipped_configs(argv)[2] == "apps/relax/recipes/qwen3_4b_dapo.yaml"  # one that is there: as is
