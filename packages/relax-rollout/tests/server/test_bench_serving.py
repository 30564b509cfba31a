"""SGLang 0.5.23's own benchmark client, unmodified, against our engine server: ``bench_serving``'s
``sglang`` (``/generate``), ``sglang-oai`` (``/v1/completions``) and ``sglang-oai-chat``
(``/v1/chat/completions``) backends, streaming on (its default). Before, all three died at warm-up:
``stream`` refused, then a 404 for completions; then each stream came as one event at the end, so the
benchmark reported a time to first token equal to the end-to-end latency and an inter-token latency of 0.
(One process runs the three, to import SGLang once.)"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

pytestmark = [pytest.mark.real_sglang, pytest.mark.integration]

BACKENDS = ("sglang", "sglang-oai", "sglang-oai-chat")
DRIVER = """
import sys
from sglang.benchmark.serving import cli_main
backends, flags = sys.argv[1].split(","), sys.argv[2:]
for backend in backends:
    print(f"== backend {backend}", flush=True)
    sys.argv = ["bench_serving", "--backend", backend, *flags]
    cli_main()
"""


def test_sglang_bench_serving_runs_against_our_server(engine_server, tiny_model_dir, sglang_python, tmp_path):
    flags = [
        "--base-url",
        engine_server,
        "--dataset-name",
        "random-ids",
        "--random-input-len",
        "6",
        "--random-output-len",
        "8",
        "--random-range-ratio",
        "1.0",
        "--num-prompts",
        "6",
        "--tokenizer",
        tiny_model_dir,
        "--model",
        tiny_model_dir,
        "--seed",
        "1",
        "--output-file",
        str(tmp_path / "results.jsonl"),
    ]
    r = subprocess.run(
        [sglang_python, "-c", DRIVER, ",".join(BACKENDS), *flags],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        cwd=tmp_path,
    )  # (it writes its results there)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    runs = out.split("== backend ")[1:]
    assert [run.split()[0] for run in runs] == list(BACKENDS), out[-3000:]
    for run in runs:
        assert "Successful requests:                     6" in run, run[-2000:]
    # token by token: the first token comes before the last, and tokens come apart
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["backend"] for r in results] == list(BACKENDS)
    for r in results:
        assert 0 < r["mean_ttft_ms"] < r["mean_e2e_latency_ms"], r
        assert r["mean_itl_ms"] > 0, r
