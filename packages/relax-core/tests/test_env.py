"""``resolve``: an environment method's result, sync or awaitable."""

from relax_core.env import resolve


class _Later:
    """An awaitable that is not a coroutine (an object with ``__await__``, as some async libraries return)."""

    def __await__(self):
        if False:
            yield
        return 7


async def _seven() -> int:
    return 7


def test_resolve_takes_plain_values_coroutines_and_other_awaitables():
    assert resolve(7) == 7
    assert resolve(_seven()) == 7
    assert resolve(_Later()) == 7  # asyncio.run alone takes coroutines only: it raised ValueError
