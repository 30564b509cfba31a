"""Training backends behind one protocol; see :func:`build_backend`."""

from relax_train.backends.base import BACKENDS, build_backend

__all__ = ["BACKENDS", "build_backend"]
