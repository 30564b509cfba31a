"""``relax_bus.Bus`` is what both backends serve: every member exists on DataBus and RayBus with the
same parameters (checked on the classes, so Ray never starts)."""

import inspect

import pytest

from relax_bus import Bus, BusConfig, ConsumerSpec, DataBus, RayBus
from relax_bus.protocol import Bus as _Bus

MEMBERS = sorted(name for name in vars(_Bus) if not name.startswith("_"))


def test_members_listed():
    assert {"put", "get", "ack", "nack", "admit", "close", "stats", "trainer_version", "config"} <= set(
        MEMBERS
    )


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("cls", [DataBus, RayBus])
@pytest.mark.parametrize("name", MEMBERS)
def test_backend_has_member(cls, name):
    proto = vars(_Bus)[name]
    if name == "config":  # an attribute on both backends: set in __init__, or a dataclass field
        assert "config" in getattr(cls, "__dataclass_fields__", {}) or (
            "self.config" in inspect.getsource(cls.__init__)
        )
        return
    impl = inspect.getattr_static(cls, name)
    if isinstance(proto, property):
        assert isinstance(impl, property), f"{cls.__name__}.{name} must be a property"
        return
    assert callable(impl), f"{cls.__name__}.{name}"
    assert _params(impl) == _params(proto), f"{cls.__name__}.{name}: {inspect.signature(impl)}"


def test_databus_instance_is_a_bus():
    assert isinstance(DataBus(BusConfig(consumers={"c": ConsumerSpec()})), Bus)
