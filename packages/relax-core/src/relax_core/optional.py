"""Optional dependencies, imported when a feature needs them and failing with the install command.

relax-core's contracts (config, protocols, registries, checkpoints, metrics.jsonl) need neither Ray nor
TensorBoard; the runs that place roles on Ray (fully async, multi-rank megatron colocate) and the
TensorBoard sink do. They are extras so that ``pip install relax-core`` stays light:
``relax-core[ray]``, ``relax-core[tensorboard]``.
"""

from __future__ import annotations

import os
from types import ModuleType

RAY_INSTALL = 'pip install "relax-core[ray]"'
TENSORBOARD_INSTALL = 'pip install "relax-core[tensorboard]"'


def import_ray(what: str = "this run") -> ModuleType:
    """``ray``, or an ImportError saying ``what`` needs it and how to install it."""
    # Under `uv run`, Ray would ship the working directory and rebuild the environment for every worker;
    # ours is already complete. Must be set before Ray is imported.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"{what} needs Ray, which relax-core leaves optional: {RAY_INSTALL}") from e
    return ray
