"""gpupipe/train/distributed.py: the launcher's variables read, or refused in one line naming them."""

import pytest

from gpupipe.train.distributed import Distributed


@pytest.mark.parametrize("name", ["LOCAL_RANK", "RANK", "WORLD_SIZE"])
def test_a_launcher_variable_that_is_no_number_is_named(monkeypatch, name):
    monkeypatch.setenv(name, "abc")
    with pytest.raises(ValueError, match=f"environment variable {name}='abc': expected a whole number >= 0"):
        Distributed("cpu")
