"""A model's forward through ``torch.compile``, eager where it cannot compile: the run says why, once.

Why a wrapper and not ``torch.compile(model)`` at the call site: compiling can be impossible (inductor on
CPU needs a C++ compiler) or fail at the first call (an operator inductor cannot lower, a graph it cannot
trace); either way the run must go on, eager, and say so — a fall-back nobody hears of is a slowdown nobody
can explain. Values are unchanged within fp32 rounding (``packages/relax-core/tests/test_compiled.py``).
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

log = logging.getLogger(__name__)


def cannot_compile() -> str | None:
    """Why ``torch.compile`` cannot run here (None where it can)."""
    import torch

    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    if not torch.cuda.is_available() and not shutil.which(os.environ.get("CXX", "c++")):
        return "inductor on CPU needs a C++ compiler (none on PATH; set CXX or install g++)"
    return None


class Compiled:
    """Calls ``module`` through ``torch.compile`` (``enabled``), else eagerly. ``what`` names it in the
    one warning a fall-back writes; :attr:`fell_back` holds the reason."""

    def __init__(self, module: Any, what: str, enabled: bool) -> None:
        self.module, self.what = module, what
        self.fell_back: str | None = None
        self._compiled = None
        if enabled:
            reason = cannot_compile()
            if reason is None:
                import torch

                self._compiled = torch.compile(module, dynamic=True)
            else:
                self._fall_back(reason)

    def _fall_back(self, reason: str) -> None:
        self.fell_back, self._compiled = reason, None
        log.warning("--torch-compile: %s runs eager: %s", self.what, reason)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None:
            return self.module(*args, **kwargs)
        try:
            return self._compiled(*args, **kwargs)
        except Exception as e:  # (it failed compiling: eager answers, or raises the real error)
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            self._fall_back(f"{type(e).__name__}: {first}")
            return self.module(*args, **kwargs)
