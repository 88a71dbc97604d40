"""``gpupipe prepare SRC s3://...``: the object-storage side of writing a prepared set. Shards are written to a local
staging folder one at a time, each uploaded as soon as it is complete (its ``.tar`` first, then its manifest) and
then deleted here, so the local disk holds one shard, never the data set. ``index.npz`` and then ``gpupipe.json`` are
uploaded last: the metadata's presence marks the set complete, as on a disk.

Resuming reads the plan and the manifests back from the store: a shard counts as done when its manifest and its
``.tar`` of the manifest's byte size are both there (a PUT is atomic: an object is whole or absent); later shard
objects are removed and written again, so an interrupted run ends with the same objects as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from itertools import count
from pathlib import Path
from typing import Any

from ..errors import StorageError
from .objstore import Remote, Store
from .shards import INDEX, META

PLAN = ".prepare-plan.json"  # as in gpupipe.prepare
_SHARD = re.compile(r"shard-(\d{6})\.(tar|json)")


class Upload:
    """A prepared set's destination at ``url``, with its local staging folder."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        self.url = url.rstrip("/")
        self.store = Store(Remote(self.url, storage_options or {}), self.url)
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        self.staging = cache / "gpupipe" / "prepare-staging" / hashlib.sha256(self.url.encode()).hexdigest()[:16]

    def at(self, name: str) -> str:
        return f"{self.url}/{name}"

    def json(self, name: str) -> dict | None:
        """An object's JSON, or None when it is absent."""
        try:
            return json.loads(self.store.cat(self.at(name)))
        except StorageError as e:
            if "no such object" in str(e):
                return None
            raise

    def start_or_resume(self, plan: dict) -> None:
        """Write the plan into an empty prefix; where one is, go on only when it is this plan. The staging folder
        starts empty, with the plan (``_finish`` removes it there)."""
        found = self.json(PLAN)
        if found is not None and found != plan:
            raise FileExistsError(
                f"{self.url}: holds an interrupted prepare of another source or with other options; "
                "remove it or choose another prefix"
            )
        if found is None and self.store.sizes(self.url):
            raise FileExistsError(f"{self.url}: not empty; prepare writes into an empty prefix (or resumes its own)")
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(parents=True)
        (self.staging / PLAN).write_text(json.dumps(plan))
        if found is None:
            self.store.put(self.staging / PLAN, self.at(PLAN))

    def complete_shards(self) -> list[dict]:
        """The manifests of the shards an earlier run uploaded whole, in order; later shard objects are removed."""
        sizes = self.store.sizes(self.url)
        done: list[dict] = []
        for k in count():
            tar, man = f"shard-{k:06d}.tar", f"shard-{k:06d}.json"
            if tar not in sizes or man not in sizes:
                break
            manifest = self.json(man)
            if manifest is None or sizes[tar] != manifest["bytes"]:
                break
            done.append(manifest)
        for name in sizes:
            m = _SHARD.fullmatch(name)
            if m and int(m[1]) >= len(done):
                self.store.rm(self.at(name))
        return done

    def shard_done(self, manifest: dict) -> None:
        """Upload a shard just closed in the staging folder (the tar, then its manifest) and delete it here."""
        tar = self.staging / manifest["shard"]
        man = tar.with_suffix(".json")
        self.store.put(tar, self.at(tar.name))
        self.store.put(man, self.at(man.name))
        tar.unlink()
        man.unlink()

    def finish(self) -> None:
        """Upload the index, then the metadata (the mark of a complete set); drop the plan and the staging folder."""
        self.store.put(self.staging / INDEX, self.at(INDEX))
        self.store.put(self.staging / META, self.at(META))
        self.store.rm(self.at(PLAN))
        shutil.rmtree(self.staging, ignore_errors=True)
