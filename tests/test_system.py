"""gpupipe/_system.py: the cores a rank may take, and its rank on the node."""

from gpupipe._system import cores_per_rank, local_rank, usable_cores


def test_the_node_cores_are_shared_among_its_ranks(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert cores_per_rank() == usable_cores()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cores_per_rank() == max(1, usable_cores() // 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(usable_cores() * 4))
    assert cores_per_rank() == 1


def test_local_rank_comes_from_torchrun(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert local_rank() is None
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_rank() == 3
