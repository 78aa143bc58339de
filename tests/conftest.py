
import pytest


@pytest.fixture
def devices(monkeypatch):
    """devices(count, kind="cuda"): this process sees `count` local accelerators (0 until called),
    so a test runs the same on a CPU box and a GPU box."""
    from accel_patch import topology_resolver

    def fake(count: int, kind: str = "cuda") -> None:
        monkeypatch.setattr(topology_resolver, "local_accelerators", lambda: (kind if count else "cpu", count))

    fake(0)
    return fake
