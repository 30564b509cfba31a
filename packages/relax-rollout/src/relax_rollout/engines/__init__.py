"""Inference engines behind one protocol; see :func:`build_engine`."""

from relax_rollout.engines.base import ENGINES, GenerateOutput, RolloutEngine, SamplingParams, build_engine

__all__ = ["ENGINES", "GenerateOutput", "RolloutEngine", "SamplingParams", "build_engine"]
