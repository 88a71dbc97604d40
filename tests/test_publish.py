"""``gpupipe prepare SRC s3://...``: a prepared set written straight to a real S3-compatible server (moto's, on
127.0.0.1), object for object what a local prepare writes, and resumable after a kill as a local prepare is."""

import signal
import subprocess
import sys
import textwrap

import pytest

from gpupipe.prepare import PrepareOptions, parse_size, prepare
from gpupipe.sources.open import open_source as scan

from .common_utils import S3Server, gpupipe_cli

SMALL = PrepareOptions(shard_size=parse_size("16KB"))


@pytest.fixture(scope="module")
def local(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("upload") / "out"
    prepare(folder, out, SMALL)
    return out


def _objects(s3, prefix: str) -> dict[str, bytes]:
    fs = s3.client()
    return {p.rsplit("/", 1)[1]: fs.cat_file(p) for p in sorted(fs.find(f"{S3Server.BUCKET}/{prefix}"))}


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.slow
def test_prepare_writes_to_s3_what_it_writes_to_a_disk(s3, folder, local):
    url = f"s3://{S3Server.BUCKET}/cli-prepared"
    run = gpupipe_cli("prepare", folder, url, "--shard-size", "16KB", "--workers", "1")
    assert run.returncode == 0, run.stderr
    assert f"{url}: prepared: 24 samples" in run.stdout.replace("\n", "")
    assert _objects(s3, "cli-prepared") == _files(local)
    assert list(scan(url).samples) == list(scan(local).samples)
    assert prepare(folder, url, SMALL).up_to_date
    with pytest.raises(FileExistsError, match=r"prepared with other settings \(--shard-size 16384 -> 32768\)"):
        prepare(folder, url, PrepareOptions(shard_size=SMALL.shard_size * 2))


_KILLED_RUN = """
import os, signal, sys
import gpupipe.prepare as p
written = []
add = p.ShardWriter.add
def add_then_die(self, *a):
    written.append(1)
    add(self, *a)
    if len(written) == {kill_at}:  # mid-shard, some shards uploaded: SIGKILL, no clean-up of any kind
        os.kill(os.getpid(), signal.SIGKILL)
p.ShardWriter.add = add_then_die
p.prepare(sys.argv[1], sys.argv[2], p.PrepareOptions(shard_size={shard_size}))
"""


@pytest.mark.slow
def test_an_interrupted_upload_resumes_to_the_same_objects(s3, folder, local):
    url = f"s3://{S3Server.BUCKET}/killed-upload"
    script = textwrap.dedent(_KILLED_RUN).format(kill_at=11, shard_size=SMALL.shard_size)
    run = subprocess.run([sys.executable, "-c", script, str(folder), url], capture_output=True, text=True)
    assert run.returncode == -signal.SIGKILL, run.stderr
    objects = _objects(s3, "killed-upload")
    assert ".prepare-plan.json" in objects and "gpupipe.json" not in objects
    shards = sorted(n for n in objects if n.endswith(".tar"))
    assert shards
    s3.client().rm_file(f"{S3Server.BUCKET}/killed-upload/{shards[-1]}")  # a manifest whose tar is gone: written again
    with pytest.raises(FileExistsError, match="interrupted prepare of another source"):
        prepare(folder, url, PrepareOptions(shard_size=SMALL.shard_size * 2))
    summary = prepare(folder, url, SMALL)
    assert 0 < summary.resumed_at < 24 and summary.out == url
    assert _objects(s3, "killed-upload") == _files(local)  # byte for byte what an uninterrupted local run writes


@pytest.mark.slow
def test_prepare_refuses_a_prefix_it_did_not_write(s3, folder):
    s3.client().pipe(f"{S3Server.BUCKET}/taken/notes.txt", b"mine")
    with pytest.raises(FileExistsError, match="not empty"):
        prepare(folder, f"s3://{S3Server.BUCKET}/taken", SMALL)
