"""Run every module's doctests: each reward's docstring is its first test."""

import doctest
import importlib

import pytest

MODULES = [
    "relax_rewards.types",
    "relax_rewards.registry",
    "relax_rewards.math",
    "relax_rewards.math_equiv",
    "relax_rewards._sympy_parse",
    "relax_rewards.scorer",
    "relax_rewards.choice",
    "relax_rewards.f1",
    "relax_rewards.format",
    "relax_rewards.ifeval",
    "relax_rewards.genrm",
    "relax_rewards.group",
    "relax_rewards.code",
    "relax_rewards.sandbox",
]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no doctests"
    assert result.failed == 0
