"""--torch-compile's wrapper: compiled where it can be, eager (said once, with why) where it cannot."""

import logging

import pytest

torch = pytest.importorskip("torch")

from relax_core.compiled import Compiled, cannot_compile  # noqa: E402


def _linear():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def test_no_compiler_on_cpu_runs_eager_and_says_why(monkeypatch, caplog):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "C++ compiler" in cannot_compile()
    m = _linear()
    with caplog.at_level(logging.WARNING):
        f = Compiled(m, "the test's forward", enabled=True)
    assert f.fell_back and "C++ compiler" in f.fell_back
    assert "--torch-compile: the test's forward runs eager: inductor on CPU needs" in caplog.text
    x = torch.randn(2, 4)
    assert torch.equal(f(x), m(x))


def test_a_compile_that_fails_at_the_first_call_falls_back_to_eager(monkeypatch, caplog):
    def broken(module, **_):
        def call(*a, **k):
            raise RuntimeError("inductor could not lower aten.frobnicate\nmore detail")

        return call

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr("relax_core.compiled.cannot_compile", lambda: None)
    m = _linear()
    f = Compiled(m, "the test's forward", enabled=True)
    x = torch.randn(2, 4)
    with caplog.at_level(logging.WARNING):
        assert torch.equal(f(x), m(x))
    assert f.fell_back == "RuntimeError: inductor could not lower aten.frobnicate"
    assert caplog.text.count("runs eager") == 1
    assert torch.equal(f(x), m(x))  # (eager from then on: no second attempt, no second warning)
    assert caplog.text.count("runs eager") == 1


def test_off_means_the_module_itself():
    m = _linear()
    f = Compiled(m, "x", enabled=False)
    assert f.fell_back is None and f._compiled is None
