"""gpupipe/train/logging.py: what a run shows (progress lines, the epoch summary)."""


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
