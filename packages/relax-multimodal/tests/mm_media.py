"""Test helpers (imported as ``mm_media``): toy tokenizers, and the media writers of
``relax_multimodal.testing`` (PIL images, mp4 via the ffmpeg inside imageio-ffmpeg, WAV via soundfile)."""

import re

import pytest

from relax_multimodal.testing import write_image, write_tone, write_video  # noqa: F401 - re-exported


def ffmpeg_or_skip() -> str:
    imageio_ffmpeg = pytest.importorskip("imageio_ffmpeg", reason="video tests write mp4 with imageio-ffmpeg")
    return imageio_ffmpeg.get_ffmpeg_exe()


class ToyTokenizer:
    """Characters as ids (ord + 1000), special tokens ``<|...|>`` as small ids; HF-style API."""

    SPECIAL = re.compile(r"<\|[^|]+\|>")

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.unk_token_id = 0

    def convert_tokens_to_ids(self, token):
        return self.vocab.setdefault(token, len(self.vocab) + 1)

    def encode(self, text, add_special_tokens=False):
        ids, pos = [], 0
        for m in self.SPECIAL.finditer(text):
            ids += [ord(c) + 1000 for c in text[pos : m.start()]]
            ids.append(self.convert_tokens_to_ids(m.group()))
            pos = m.end()
        return ids + [ord(c) + 1000 for c in text[pos:]]


class CrashingTokenizer(ToyTokenizer):
    """Kills its process when asked to encode "CRASH" (stands in for a decoder segfault in a worker)."""

    def encode(self, text, add_special_tokens=False):
        if "CRASH" in text:
            import os

            os._exit(1)
        return super().encode(text, add_special_tokens)


class UnstartableTokenizer(ToyTokenizer):
    """Kills the process that unpickles it: a pool worker dies while starting, before taking any sample."""

    def __setstate__(self, state):
        import os

        os._exit(1)
