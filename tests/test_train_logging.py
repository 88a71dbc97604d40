"""gpupipe/train/logging.py: what a run shows (progress lines, the epoch summary)."""

import os
import re
import signal
import time

import pytest
from torch import nn

from gpupipe.train.logging import REFRESH_S
from gpupipe.train.loop import train
from gpupipe.train.stop import Stopped

from .common_utils import make_folder, train_config


def test_ddp_progress_labels_rank_zero_and_summary_all_ranks(tmp_path):
    import io

    from rich.console import Console

    from gpupipe.train.logging import Meter, RunLogger

    logger = RunLogger(tmp_path, enabled=True, total=4, world_size=2)
    buf = io.StringIO()
    logger.console = Console(file=buf, width=80, soft_wrap=True)
    logger.start_epoch(0, 0)
    logger.progress(4, Meter(images=64, time=1.0, wait=0.1, loss=64.0), 0.1, 4)
    logger.end_epoch({"epoch": 0, "train_loss": 1.0, "images_per_s": 128.0, "data_wait": 0.1}, None)
    logger.close()
    text = buf.getvalue()
    assert "64 img/s (rank 0)" in text and "all 2 ranks" in text


class _Tiny(nn.Module):
    """A model whose forward calls ``hook(n)`` first, ``n`` counting its training forwards from 1."""

    def __init__(self, hook):
        super().__init__()
        self.conv, self.head, self.hook, self.calls = nn.Conv2d(3, 4, 3, stride=4), nn.Linear(4, 2), hook, 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            self.hook(self.calls)
        return self.head(self.conv(x).relu().mean((2, 3)))


def _progress_lines(err: str) -> list[str]:
    """The ``done/total`` of each progress line in a pipe (``epoch 0  5/20  loss ...``)."""
    return re.findall(r"^epoch 0  (\d+/\d+)  loss ", err, flags=re.MULTILINE)


@pytest.mark.slow  # 4 batches of over half a second
def test_slow_batches_each_move_the_progress_between_log_every_updates(tmp_path, capsys):
    """The probe: the progress moved every --log-every batches only (10 by default), so on a CPU it stood at 0/18 for
    half a minute. A batch slower than the refresh interval moves it each time."""
    data = make_folder(tmp_path / "data", 2, 2, sizes=((40, 40),))
    cfg = train_config(data, tmp_path / "run", epochs=1, batch_size=1, log_every=1000)
    train(cfg, model=_Tiny(lambda n: time.sleep(REFRESH_S + 0.05)))
    assert _progress_lines(capsys.readouterr().err) == ["1/4", "2/4", "3/4", "4/4"]


def test_a_stop_shows_the_batch_where_the_run_saved(tmp_path, capsys):
    """Ctrl-C during batch 5 of 20: the run saves after it, and the progress says 5/20 (it said 0/20 or 10/20)."""
    data = make_folder(tmp_path / "data", 2, 10, sizes=((40, 40),))
    cfg = train_config(data, tmp_path / "run", epochs=1, batch_size=1, log_every=1000)
    with pytest.raises(Stopped, match="checkpoint saved at epoch 0, batch 5 "):
        train(cfg, model=_Tiny(lambda n: n == 5 and os.kill(os.getpid(), signal.SIGINT)))
    assert _progress_lines(capsys.readouterr().err)[-1] == "5/20"
