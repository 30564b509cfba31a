"""Ray and TensorBoard are extras of relax-core: every module imports without Ray, and a run that needs it
fails with the install command."""

from __future__ import annotations

import subprocess
import sys

import pytest

from relax_core.optional import RAY_INSTALL, import_ray


def test_import_ray_names_the_extra_when_ray_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import raises ImportError
    with pytest.raises(ImportError, match="--fully-async needs Ray") as err:
        import_ray("--fully-async")
    assert str(err.value).endswith('pip install "relax-core[ray]"') and RAY_INSTALL in str(err.value)


def test_every_module_imports_without_ray():
    code = """
import importlib, pkgutil, sys
sys.modules["ray"] = None  # importing ray raises ImportError
import relax_core
for m in pkgutil.iter_modules(relax_core.__path__):
    importlib.import_module("relax_core." + m.name)
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_a_fully_async_run_without_ray_says_what_to_install(monkeypatch):
    from relax_core.async_run import AsyncRun

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r'--fully-async needs Ray.*pip install "relax-core\[ray\]"'):
        AsyncRun(cfg=None, inputs=None, notifier=None, threads=1)
