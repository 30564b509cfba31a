"""Exceptions raised by the bus.

Everything derives from :class:`BusError` so a role can catch one type. The subclasses exist because callers
react differently: a :class:`BusTimeout` is routine (poll again), :class:`BusClosed` means shut down, and a
:class:`StaleSampleError` is a bug in the producer's use of ``admit()``. All of them carry only a message so
they pickle across Ray unchanged.
"""

from __future__ import annotations


class BusError(Exception):
    """A call was invalid (bad input, unknown id or lease); the bus is left unchanged."""


class BusClosed(BusError):
    """The bus was closed; every waiter is woken with this and later calls raise it."""


class DuplicateIds(BusError):
    """A put named sample ids this bus already used: the batch landed before (a producer that restarted
    re-sends it). Producers that give deterministic ids treat this as "already there"; nothing was written."""


class BusTimeout(BusError, TimeoutError):
    """A blocking call (``put``, ``get``, ``admit``) ran past its ``timeout``; nothing was taken or written."""


class ConsumerReset(BusError):
    """A ``get`` was waiting when its consumer was reset (``reset_consumer``: its process died). It takes
    nothing: the samples it waited for go to the restarted consumer. Seen only by a caller that is still
    alive after all (the consumer was reset by mistake, or a second process uses its name): get again."""


class StaleSampleError(BusError):
    """Under ``staleness_policy="wait"``, a sample older than ``max_staleness`` reached a training consumer.

    Producers are expected to call ``admit(step)`` before generating, which makes this impossible.
    """
