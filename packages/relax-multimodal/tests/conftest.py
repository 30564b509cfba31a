"""Fixtures; the media writers live in ``mm_media.py`` (imported by the tests through sys.path)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from mm_media import ToyTokenizer  # noqa: E402


@pytest.fixture
def toy_tokenizer():
    return ToyTokenizer()
