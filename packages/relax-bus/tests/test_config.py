import pytest
from pydantic import ValidationError

from relax_bus import BusConfig, ConsumerSpec


def test_every_field_documented():
    for model in (BusConfig, ConsumerSpec):
        for name, f in model.model_fields.items():
            assert f.description, f"{model.__name__}.{name} has no docstring"
    assert "0 = strict on-policy" in BusConfig.model_fields["max_staleness"].description


def test_bounds_and_clear_errors():
    with pytest.raises(ValidationError, match="max_staleness"):
        BusConfig(consumers={"a": ConsumerSpec()}, max_staleness=-1)
    with pytest.raises(ValidationError, match="capacity"):
        BusConfig(consumers={"a": ConsumerSpec()}, capacity=0)
    with pytest.raises(ValidationError, match="unknown sampler 'nope'"):
        ConsumerSpec(sampler="nope")
    with pytest.raises(ValidationError, match="staleness_policy"):
        BusConfig(consumers={"a": ConsumerSpec()}, staleness_policy="later")
    with pytest.raises(ValidationError, match="consumers"):
        BusConfig(consumers={})
    with pytest.raises(ValidationError, match="group_size"):
        BusConfig(consumers={"a": ConsumerSpec(sampler="group")}, capacity=4, group_size=8)


def test_from_dict():
    cfg = BusConfig.model_validate({"consumers": {"t": {"required_fields": ["x"], "sampler": "group"}}})
    assert cfg.consumers["t"].sampler == "group" and cfg.max_staleness == 1
