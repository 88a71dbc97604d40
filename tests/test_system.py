"""gpupipe/_system.py: the cores a rank may take, and its rank on the node."""

import pytest

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


def test_a_rank_that_is_no_number_is_an_error_naming_its_variable(monkeypatch):
    for bad in ("abc", "\u0663", "-1", "1_0"):  # \u0663: an Arabic-Indic three, which int() would take
        monkeypatch.setenv("LOCAL_RANK", bad)
        with pytest.raises(ValueError, match=f"environment variable LOCAL_RANK={bad!r}: expected a whole number"):
            local_rank()
    monkeypatch.setenv("LOCAL_RANK", "")
    assert local_rank() is None
