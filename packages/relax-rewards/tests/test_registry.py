"""The registry: names, dotted paths, entry points, rm_type resolution."""

import sys
import types
from importlib.metadata import EntryPoint

import pytest

import relax_rewards.registry as registry
from relax_rewards import get_reward, list_rewards, register, resolve_reward_type
from relax_rewards.math import dapo_reward, deepscaler_reward, math_reward


def test_builtins_are_registered():
    assert get_reward("math") is math_reward
    assert get_reward("deepscaler") is deepscaler_reward
    assert get_reward("dapo") is dapo_reward
    assert {"math", "deepscaler", "dapo"} <= set(list_rewards())


def test_register_and_lookup(clean_registry):
    @register("always_one", "one")
    def always_one(response, label, metadata=None):
        return 1.0

    assert get_reward("always_one") is always_one
    assert get_reward("one") is always_one
    assert always_one("x", None) == 1.0  # the decorator returns the function unchanged


def test_register_async_entry(clean_registry):
    @register("async_one")
    async def async_one(response, label, metadata=None):
        return 1.0

    assert get_reward("async_one") is async_one


def test_duplicate_name_is_an_error(clean_registry):
    @register("dup")
    def first(response, label, metadata=None):
        return 0.0

    with pytest.raises(ValueError, match="already registered"):

        @register("dup")
        def second(response, label, metadata=None):
            return 1.0

    @register("dup", overwrite=True)
    def third(response, label, metadata=None):
        return 1.0

    assert get_reward("dup") is third


def test_register_rejects_bad_names():
    with pytest.raises(ValueError):
        register()
    with pytest.raises(ValueError):
        register("")


def test_unknown_name_lists_registered():
    with pytest.raises(KeyError) as info:
        get_reward("no_such_reward")
    message = str(info.value)
    assert "no_such_reward" in message and "math" in message and "dapo" in message


def test_dotted_paths():
    assert get_reward("relax_rewards.math:math_reward") is math_reward
    assert get_reward("relax_rewards.math.math_reward") is math_reward


def test_dotted_path_loads_lazily(tmp_path, monkeypatch):
    (tmp_path / "user_rewards_mod.py").write_text(
        "def length_reward(response, label, metadata=None):\n    return float(len(response))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "user_rewards_mod" not in sys.modules
    fn = get_reward("user_rewards_mod:length_reward")
    assert fn("abc", None) == 3.0


def test_bad_dotted_paths():
    with pytest.raises(KeyError, match="cannot import"):
        get_reward("not_a_module_xyz:fn")
    with pytest.raises(KeyError, match="no attribute"):
        get_reward("relax_rewards.math:nope")
    with pytest.raises(KeyError, match="not callable"):
        get_reward("relax_rewards.math:MAX_RESPONSE_CHARS")


def test_callable_passes_through():
    def fn(response, label, metadata=None):
        return 0.0

    assert get_reward(fn) is fn


def test_entry_points(monkeypatch, clean_registry):
    module = types.ModuleType("fake_third_party")
    module.score = lambda response, label, metadata=None: 0.25
    monkeypatch.setitem(sys.modules, "fake_third_party", module)
    ep = EntryPoint(name="third_party", value="fake_third_party:score", group=registry.ENTRY_POINT_GROUP)

    def fake_entry_points(group):
        return [ep] if group == registry.ENTRY_POINT_GROUP else []

    monkeypatch.setattr(registry, "entry_points", fake_entry_points)
    assert "third_party" in list_rewards()
    assert get_reward("third_party")("x", None) == 0.25


def test_resolve_reward_type():
    assert resolve_reward_type({"rm_type": "dapo"}, "math") == "dapo"
    assert resolve_reward_type({"other": 1}, "math") == "math"
    assert resolve_reward_type(None, "math") == "math"
    with pytest.raises(KeyError, match="rm_type"):
        resolve_reward_type({}, None)
