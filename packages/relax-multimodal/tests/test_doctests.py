import doctest

import relax_multimodal
from relax_multimodal import specs


def test_doctests():
    for mod in (relax_multimodal, specs):
        result = doctest.testmod(mod)
        assert result.failed == 0 and result.attempted > 0, mod.__name__
