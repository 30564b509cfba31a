"""Loaded by pytest before any test (the repository root is its rootdir), for every test path.

Python compiles a module from source at every import when it may not write the compiled file beside it
(``PYTHONDONTWRITEBYTECODE``, which some images set, our development machines' included). torch,
transformers, megatron-core and SGLang then cost 10-30 s of CPU in each process that imports them, and the
suite starts hundreds (Ray's role processes, engine servers, SGLang's scheduler and detokenizer): measured
on 2 cores, a fully-async test run took 46 s with it and 25 s without, importing SGLang 30 s and 15 s. So the
tests write the compiled files: once, in the first process that imports a module; read by every later one.
"""

import os
import sys

os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # (the processes the tests start, Ray's workers included)
sys.dont_write_bytecode = False
