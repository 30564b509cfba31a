"""Shared fixtures: a tiny Qwen3 policy and a character-level tokenizer saved as an HF checkpoint."""

import pytest

from relax_testing import build_tiny_checkpoint, single_thread_torch


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    import torch

    torch.set_num_threads(1)
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(autouse=True)
def _single_thread_torch():
    single_thread_torch()
