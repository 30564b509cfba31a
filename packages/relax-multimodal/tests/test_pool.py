import os

import pytest
from mm_media import ToyTokenizer, write_image

from relax_multimodal import MultimodalConfig, MultimodalProcessor, PoolStartError, PreprocessPool


@pytest.fixture(scope="module")
def pool_and_rows(tmp_path_factory):
    d = tmp_path_factory.mktemp("pool")
    paths = [write_image(d / f"{i}.png", size=(60 + 10 * i, 40)) for i in range(6)]
    rows = [{"prompt": f"<image> #{i}", "img": p} for i, p in enumerate(paths)]
    rows.insert(3, {"prompt": "<image>", "img": str(d / "missing.png")})
    cfg = MultimodalConfig(multimodal_keys={"image": "img"})
    biggest = max(os.path.getsize(p) for p in paths)
    with PreprocessPool(cfg, ToyTokenizer(), workers=2, max_inflight_bytes=2 * biggest) as pool:
        yield pool, rows, cfg, biggest


def test_pool_matches_inline_and_keeps_order(pool_and_rows):
    pool, rows, cfg, _ = pool_and_rows
    res = MultimodalProcessor(cfg, ToyTokenizer()).process_batch(rows, pool=pool)
    inline = MultimodalProcessor(cfg, ToyTokenizer()).process_batch(rows)
    assert [s.index for s in res.samples] == [0, 1, 2, 4, 5, 6] == [s.index for s in inline.samples]
    assert res.counts == {"missing": 1}
    assert res.samples[0].row is rows[0]
    for a, b in zip(res.samples, inline.samples):
        assert a.text == b.text and (a.images[0].array == b.images[0].array).all()
    assert pool.peak_inflight_bytes <= 2 * pool_and_rows[3]


def test_pool_rejects_zero_budget():
    with pytest.raises(ValueError, match="max_inflight_bytes must be > 0"):
        PreprocessPool(MultimodalConfig(), max_inflight_bytes=0)


def test_worker_crash_fails_the_sample_and_the_pool_goes_on(tmp_path):
    from mm_media import CrashingTokenizer

    p = write_image(tmp_path / "a.png")
    rows = [{"prompt": t, "img": p} for t in ("one", "CRASH", "three", "four")]
    cfg = MultimodalConfig(multimodal_keys={"image": "img"})
    with PreprocessPool(cfg, CrashingTokenizer(), workers=1) as pool:
        res = MultimodalProcessor(cfg).process_batch(rows, pool=pool)
    good = [s.index for s in res.samples]
    assert 1 not in good and {2, 3} <= set(good) and res.counts["crash"] >= 1
    assert any("worker died" in str(e) and e.sample == 1 for e in res.skipped)


def test_workers_that_cannot_start_raise_instead_of_skipping(tmp_path):
    from mm_media import UnstartableTokenizer

    cfg = MultimodalConfig(multimodal_keys={"image": "img"})
    with pytest.raises(PoolStartError, match="died while starting, before any sample"):
        PreprocessPool(cfg, UnstartableTokenizer(), workers=1)
