import os

import pytest

from relax_bus import BusConfig, ConsumerSpec, DataBus


@pytest.fixture
def simple_bus():
    return DataBus(
        BusConfig(consumers={"a": ConsumerSpec(), "b": ConsumerSpec(required_fields=["x"])}, capacity=8)
    )


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray cluster per test module (starting one costs seconds); not per session: the
    cross-package runs after these tests start clusters of their own sizes."""
    ray = pytest.importorskip("ray")
    os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"  # under `uv run`, workers reuse this venv as is
    if not ray.is_initialized():
        ray.init(
            address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False
        )
    yield ray
    ray.shutdown()
