"""Where the node's shard cache (:mod:`.cache`) lives and who may share it: the default folder is the user's own
(``$XDG_CACHE_HOME/gpupipe/shards``, mode 0700); ``$GPUPIPE_CACHE`` or ``Remote(cache_dir=)`` names another, which a
group shares by choice (group-writable, its users members); a folder every user may write is refused. And the
digests that tell a cached shard's bytes are the object's."""

from __future__ import annotations

import hashlib
import os
import re
import stat
from pathlib import Path
from typing import Any

from ..errors import StorageError

CHOOSE = "$GPUPIPE_CACHE, Remote(cache_dir=), default $XDG_CACHE_HOME/gpupipe/shards"


def cache_folder() -> Path:
    """The default shard cache: ``$GPUPIPE_CACHE``, else ``$XDG_CACHE_HOME/gpupipe/shards`` (``~/.cache/...``)."""
    if os.environ.get("GPUPIPE_CACHE"):
        return Path(os.environ["GPUPIPE_CACHE"])
    return private_folder()


def private_folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpupipe" / "shards"


SHARE_FIX = "or share one with a group: chgrp GROUP FOLDER && chmod 2770 FOLDER, every user a member of GROUP"


def check_folder(folder: Path) -> int | None:
    """Make or check a cache folder; returns the group whose members' shards are trusted (None: this user's only).

    A folder made here is this user's (mode 0700), as is the default one (made private if it was not). A folder every
    user may write is refused (any user could plant shards there), as is one this user cannot write. A group
    shares a folder by choice: group-writable, this user a member (the setgid bit gives each file the group)."""
    own = folder == private_folder()
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = folder.stat()
        if own and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077:
            folder.chmod(0o700)
            st = folder.stat()
    except OSError as e:
        raise StorageError(f"{folder}: cannot make the shard cache folder ({e.strerror}); {CHOOSE}") from None
    mode, fix = stat.S_IMODE(st.st_mode), f"use a folder of your own ({CHOOSE}), {SHARE_FIX}"
    if mode & 0o002:
        raise StorageError(
            f"{folder}: the shard cache folder is writable by every user (mode {mode:04o}): anyone could plant "
            f"shards in it; {fix}"
        )
    if (own and st.st_uid != os.geteuid()) or not os.access(folder, os.W_OK | os.X_OK):
        raise StorageError(
            f"{folder}: the shard cache folder is not this user's (owner uid {st.st_uid}, group gid {st.st_gid}, "
            f"mode {mode:04o}); {fix}"
        )
    shared = mode & 0o020 and st.st_gid in {os.getegid(), *os.getgroups()}
    return st.st_gid if shared else None


def md5_in_etag(etag: str) -> str | None:
    """The MD5 of the object's bytes where its ETag is one (S3's for a single-part upload), else None."""
    found = re.fullmatch(r'"?([0-9a-fA-F]{32})"?', etag.strip())
    return found[1].lower() if found else None


def sha256_of(path: Path) -> str:
    return digest_of(path, hashlib.sha256())


def md5_of(path: Path) -> str:
    return digest_of(path, hashlib.md5(usedforsecurity=False))


def digest_of(path: Path, h: Any) -> str:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_digest(path: Path, digest: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with open(fd, "w") as f:
        f.write(digest + "\n")
    os.replace(tmp, path)
