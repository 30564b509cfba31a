"""Run the algorithm modules' doctests, and the Advantages role's (the examples in the docstrings are part of
the contract)."""

import doctest
import importlib

import pytest


@pytest.mark.parametrize(
    "module",
    [
        "relax_train.algorithms.advantages",
        "relax_train.algorithms.losses",
        "relax_train.algorithms.aggregation",
        "relax_train.algorithms.correction",
        "relax_train.algorithms.gae",
        "relax_train.roles.advantages",
    ],
)
def test_doctests(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0
