"""The node's shard cache (gpupipe/sources/cache.py, cache_folder.py) used by several users of one machine, each a real
uid (the test runs as root and starts the other users' processes under their uids; skipped otherwise): a folder
every user may write is refused, a shard another user planted or altered is fetched again and never read, and the
members of a group that shares a folder read each other's shards, with every failure one line naming the folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import gpupipe
from gpupipe import Remote
from gpupipe.errors import StorageError
from gpupipe.prepare import PrepareOptions, prepare
from gpupipe.sources.cache import ShardCache
from gpupipe.sources.open import open_source as scan

from .common_utils import REPO_ROOT

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="starts processes as other uids: needs root (as CI runs)")
GROUP = 65534  # nogroup: the group that shares a folder (setgid works for any number, listed in /etc/group or not)
B, C, D = 65534, 65533, 65532  # nobody, and two uids with no name: B and C share GROUP, D does not


@pytest.fixture(scope="module")
def prepared(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("users") / "prepared"
    prepare(folder, out, PrepareOptions(shard_size=16 * 1024, order="shuffled"))
    return out


@pytest.fixture
def place():
    """A folder every test user can reach (pytest's own are root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="gpupipe-users-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def shared(place: Path, mode: int = 0o2770) -> Path:
    """A cache folder shared by GROUP: group-writable, setgid (each file takes the group)."""
    folder = place / "cache"
    folder.mkdir()
    os.chown(folder, 0, GROUP)
    folder.chmod(mode)
    return folder


_READ = """
import json, sys
import gpupipe
url, cache, on_error = sys.argv[1:]
try:
    loader = gpupipe.build_loader(gpupipe.Remote(url, cache_dir=cache), "pillow", train=False, batch_size=4,
                                  image_size=24, num_workers=0, device="cpu", normalize=False, on_error=on_error)
    labels = [y.tolist() for _, y in loader]
    print(json.dumps({"labels": labels, "fetches": loader.dataset.cache.cache.fetches}))
except gpupipe.errors.GpupipeError as e:
    print(f"error: {e}")
    sys.exit(3)
"""

# What a _READ run loads lazily (modules, the store client's models), loaded as root before the process takes the
# user's uid: the interpreter and the packages may sit where other users cannot read (root's /root, as here and in CI)
_WARM_READ = """
import gc, sys, tempfile, threading, gpupipe
with tempfile.TemporaryDirectory() as cache:
    loader = gpupipe.build_loader(gpupipe.Remote(sys.argv[1], cache_dir=cache), "pillow", train=False, batch_size=4,
                                  image_size=24, num_workers=0, device="cpu", normalize=False)
    for _ in loader:
        pass
    # the read ahead has moved on to the next epoch's first shards: it ends with its loader, before the folder goes
    del loader
    gc.collect()
    for t in threading.enumerate():
        if t.name == "gpupipe-read-ahead":
            t.join(120)
"""

# Started as root: runs the warm-up script (GPUPIPE_TEST_WARM), then takes the uid and groups, then runs the script
_AS_USER = """
import os, sys
uid = int(os.environ.pop("GPUPIPE_TEST_UID"))
groups = [int(g) for g in os.environ.pop("GPUPIPE_TEST_GROUPS").split(",") if g]
script, warm = sys.argv[1], os.environ.pop("GPUPIPE_TEST_WARM", "")
sys.argv = ["-c", *sys.argv[2:]]
if warm:
    exec(compile(warm, "<warm-up>", "exec"), {"__name__": "__warm__"})
os.setgroups(groups)
os.setgid(uid)
os.setuid(uid)
exec(compile(script, "<script>", "exec"), {"__name__": "__main__"})
"""

_PLANT = """
import hashlib, os, sys
path, forge, data = sys.argv[1], sys.argv[2] == "forge", bytes.fromhex(sys.stdin.read())
files = [(path, data)] + [(path + ".sha256", hashlib.sha256(data).hexdigest().encode())] * forge  # a digest to match
for name, content in files:
    open(name + ".new", "wb").write(content)
    os.replace(name + ".new", name)  # over whoever's file was there
"""


def as_user(uid: int, script: str, *args: str, groups: tuple[int, ...] = (), stdin: str = "", place: Path):
    """``script`` run by ``uid`` (its own group, and ``groups``), with a home of its own under ``place``. The process
    starts as root and takes the uid before the script runs (after the warm-up of a _READ, which loads as root what
    the script would load from folders the user may not read)."""
    home = place / f"home-{uid}"
    home.mkdir(exist_ok=True)
    os.chown(home, uid, uid)
    path = os.pathsep.join([str(REPO_ROOT), *(p for p in sys.path if p)])  # this process's packages, found alike
    env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), "PYTHONPATH": path}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["GPUPIPE_TEST_UID"], env["GPUPIPE_TEST_GROUPS"] = str(uid), ",".join(map(str, (uid, *groups)))
    env["GPUPIPE_TEST_WARM"] = _WARM_READ if script is _READ else "import hashlib"  # _PLANT's one import
    return subprocess.run(
        [sys.executable, "-c", _AS_USER, script, *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        cwd=str(place),
        timeout=300,
    )


def altered(shard: Path) -> bytes:
    """The shard with every byte of its JPEGs' data changed (the tar headers kept): the same size, other pixels."""
    data = bytearray(shard.read_bytes())
    for i in range(1024, len(data) - 1024, 97):
        data[i] ^= 0x5A
    return bytes(data)


def test_a_folder_every_user_may_write_is_refused_and_a_planted_shard_never_read(s3, prepared, place):
    """In a folder like /tmp (sticky, world-writable), another user plants a shard under the name the cache computes
    (public: the URL, size and ETag): the loader refuses the folder in one line naming it and the fix."""
    url = s3.upload(prepared, "planted")
    folder = place / "tmp"
    folder.mkdir()
    folder.chmod(0o1777)
    info = scan(Remote(url, cache_dir=str(place / "mine"))).cache
    name = ShardCache.name(info.urls[0], info.sizes[0], info.etags[0])
    planted = as_user(
        B, _PLANT, str(folder / name), "forge", stdin=altered(prepared / "shard-000000.tar").hex(), place=place
    )
    assert planted.returncode == 0, planted.stderr
    with pytest.raises(StorageError, match=rf"^{folder}: the shard cache folder is writable by every user") as e:
        gpupipe.build_loader(Remote(url, cache_dir=str(folder)), "pillow", batch_size=4, num_workers=0, device="cpu")
    assert "chmod 2770" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_a_shard_another_user_planted_or_altered_is_fetched_again_never_read(s3, prepared, place):
    """A group-shared folder: B (a member) plants an altered shard with a digest to match: root, no member, trusts
    none of B's files. B replaces the shard root fetched again, its digest kept: C, a member, trusts B's file, but
    its bytes are not what the store served. Each fetches the shard again and reads the store's bytes."""
    url = s3.upload(prepared, "altered")
    folder = shared(place)
    data = scan(Remote(url, cache_dir=str(folder)))
    name = ShardCache.name(data.cache.urls[0], data.cache.sizes[0], data.cache.etags[0])
    real = (prepared / "shard-000000.tar").read_bytes()
    fake = altered(prepared / "shard-000000.tar").hex()
    for reader, forge in ((0, "forge"), (C, "keep")):
        planted = as_user(B, _PLANT, str(folder / name), forge, stdin=fake, place=place)
        assert planted.returncode == 0, planted.stderr
        if reader == 0:
            cache = ShardCache(folder, 1 << 30)
            with cache.pin(data.store, data.cache.urls[0], len(real), data.cache.etags[0]) as pinned:
                assert pinned.read(0, len(real)) == real and cache.fetches == 1
        else:
            r = as_user(C, _READ, url, str(folder), "raise", groups=(GROUP,), place=place)
            assert r.returncode == 0, r.stdout + r.stderr
            assert json.loads(r.stdout)["fetches"] >= 1
        assert (folder / name).read_bytes() == real
        assert os.stat(folder / name).st_uid == reader  # fetched again over the planted file


@pytest.mark.slow
def test_the_members_of_a_sharing_group_read_each_others_shards(s3, prepared, place):
    """B fetches into a folder its group shares (files 0644 under the usual umask); C, a member too, reads every
    sample from B's copies, fetching nothing, even with on_error="skip" (no permission error turned into skipped
    samples); D, no member, is refused in one line naming the folder and the fix, whatever on_error says."""
    url = s3.upload(prepared, "group")
    folder = shared(place)
    first = as_user(B, _READ, url, str(folder), "raise", groups=(GROUP,), place=place)
    assert first.returncode == 0, first.stdout + first.stderr
    labels = json.loads(first.stdout)["labels"]
    assert sum(map(len, labels)) == 24 and json.loads(first.stdout)["fetches"] == len(list(prepared.glob("*.tar")))
    second = as_user(C, _READ, url, str(folder), "skip", groups=(GROUP,), place=place)
    assert second.returncode == 0, second.stdout + second.stderr
    assert json.loads(second.stdout) == {"labels": labels, "fetches": 0}
    outsider = as_user(D, _READ, url, str(folder), "skip", place=place)
    assert outsider.returncode == 3 and outsider.stdout.count("\n") == 1, outsider.stdout + outsider.stderr
    assert outsider.stdout.startswith(f"error: {folder}: the shard cache folder is not this user's")
    assert "chmod 2770" in outsider.stdout


@pytest.mark.slow
def test_another_users_leftover_the_sticky_bit_keeps_is_the_folders_error_not_the_stores(s3, prepared, place):
    """A shared folder with the sticky bit (mode 3770): a fetch B left half done cannot be removed by C. C's run stops
    in one line naming the cache folder, the file and the fix (it blamed the store's credentials)."""
    url = s3.upload(prepared, "sticky")
    folder = shared(place, 0o3770)
    data = scan(Remote(url, cache_dir=str(place / "mine")))
    first = int(data._shard[0])
    name = ShardCache.name(data.cache.urls[first], data.cache.sizes[first], data.cache.etags[first])
    planted = as_user(B, _PLANT, str(folder / f"{name}.part"), "keep", stdin=b"half".hex(), place=place)
    assert planted.returncode == 0, planted.stderr
    r = as_user(C, _READ, url, str(folder), "skip", groups=(GROUP,), place=place)
    assert r.returncode == 3 and r.stdout.count("\n") == 1, r.stdout + r.stderr
    assert r.stdout.startswith(
        f"error: {folder}: the shard cache refuses this user (Operation not permitted: {folder}/"
    )
    assert "check the credentials" not in r.stdout and "chmod 2770" in r.stdout
