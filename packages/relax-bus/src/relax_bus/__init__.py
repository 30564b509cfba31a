"""relax_bus: a streaming data bus for RL with per-sample policy versions and exact staleness control.

Imports neither torch nor ray; the Ray backend imports ray only when used, the loader torch only if present.
"""

from relax_bus._version import __version__ as __version__
from relax_bus.aio import AsyncBus, AsyncDataBus
from relax_bus.config import BusConfig, ConsumerSpec
from relax_bus.core import DataBus
from relax_bus.errors import BusClosed, BusError, BusTimeout, ConsumerReset, DuplicateIds, StaleSampleError
from relax_bus.loader import StreamingDataLoader, collate
from relax_bus.protocol import Bus
from relax_bus.ray_backend import RayBus
from relax_bus.samplers import SAMPLERS, SampleRef, register_sampler
from relax_bus.staleness import StalenessBound
from relax_bus.state import Batch, BusState, ManualClock

__all__ = [
    "AsyncBus",
    "AsyncDataBus",
    "Batch",
    "Bus",
    "BusClosed",
    "BusConfig",
    "BusError",
    "BusState",
    "BusTimeout",
    "ConsumerReset",
    "DuplicateIds",
    "ConsumerSpec",
    "DataBus",
    "ManualClock",
    "RayBus",
    "SAMPLERS",
    "SampleRef",
    "StaleSampleError",
    "StalenessBound",
    "StreamingDataLoader",
    "collate",
    "register_sampler",
]
