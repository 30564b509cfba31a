"""Training backends behind one protocol; see :func:`build_backend`."""

from relax_train.backends.base import BACKENDS, StreamedUpdate, TrainBackend, build_backend

__all__ = ["BACKENDS", "StreamedUpdate", "TrainBackend", "build_backend"]
