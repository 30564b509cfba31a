"""The root ``conftest.py``: the processes the tests start may write compiled modules (see its docstring)."""

import subprocess
import sys


def test_the_tests_and_the_processes_they_start_write_compiled_modules():
    """Where the image sets PYTHONDONTWRITEBYTECODE, every process would compile torch et al. again."""
    assert not sys.dont_write_bytecode
    code = "import os, sys; print(sys.dont_write_bytecode, os.environ.get('PYTHONDONTWRITEBYTECODE'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "None"]
