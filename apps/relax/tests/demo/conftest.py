import pytest
import torch

from relax_app.demo.task import make_arithmetic_task, read_jsonl
from relax_app.demo.tokenizer import train_tokenizer

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def tiny_model():
    """Model sizes small enough for a few SFT steps in well under a second."""
    return dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory):
    return make_arithmetic_task(tmp_path_factory.mktemp("task"), seed=0, max_operand=19, n_eval=20)


@pytest.fixture(scope="session")
def tokenizer(tiny_task):
    rows = read_jsonl(tiny_task.train_path)
    return train_tokenizer([r["prompt"] + r["label"] for r in rows])
