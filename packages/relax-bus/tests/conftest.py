import pytest

from relax_bus import BusConfig, ConsumerSpec, DataBus


@pytest.fixture
def simple_bus():
    return DataBus(
        BusConfig(consumers={"a": ConsumerSpec(), "b": ConsumerSpec(required_fields=["x"])}, capacity=8)
    )
