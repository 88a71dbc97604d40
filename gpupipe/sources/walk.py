"""The ImageFolder walk, safe on any tree: torchvision's classes, labels and order on ordinary folders, and on
hostile ones no escape, no loop, no recursion limit, no hang.

- A link to a **file** is followed when it leads to a regular file inside the root (anywhere with
  ``allow_outside_root``). A link to a **folder** is not followed (with ``allow_outside_root`` it is, each folder at
  most once, so a loop ends). torchvision follows every link: ``ln -s .. data/c00/up`` turned 16 files into 656.
- Entries that cannot be samples are left out and listed in ``problems`` (path, reason): folders it cannot read,
  fifos and devices under image names, links left unfollowed, broken links.
- The walk keeps its own stack: a tree thousands of folders deep is no ``RecursionError``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import NamedTuple

from torchvision.datasets.folder import IMG_EXTENSIONS

from ..errors import MissingFileError

_KINDS = {stat.S_IFIFO: "a fifo", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}
_KINDS[stat.S_IFSOCK] = "a socket"
SHOWN = 5  # names listed in a message before "and N more"


class Walked(NamedTuple):
    classes: list[str]
    class_to_idx: dict[str, int]
    samples: list[tuple[str, int]]
    problems: list[tuple[str, str]]  # (path, why it was left out)


class _Walk:
    """One walk of ``root``: the state its steps share."""

    def __init__(self, root: str, extensions: tuple[str, ...], allow_outside_root: bool):
        self.root, self.extensions, self.follow_folders = root, extensions, allow_outside_root
        self.real_root = os.path.realpath(root)
        self.allow_outside_root = allow_outside_root
        self.problems: list[tuple[str, str]] = []
        self.visited: set[tuple[int, int]] = set()

    def classes(self) -> list[str]:
        """The class folders: ``root``'s sub-folders (links to folders as the walk treats them)."""
        names = []
        for entry in self._entries(self.root):
            if entry.is_symlink() and not self._follow_link(entry):
                continue
            if _is_dir(entry):
                names.append(entry.name)
        return sorted(names)

    def files(self, top: str) -> list[str]:
        """The image files under ``top``, in torchvision's order (folders by path, files by name)."""
        found: list[tuple[str, list[str]]] = []
        stack = [top]
        self._first_visit(top)
        while stack:
            folder = stack.pop()
            names = []
            for entry in self._entries(folder):
                if entry.is_symlink() and not self._follow_link(entry):
                    continue
                if _is_dir(entry):
                    if self._first_visit(entry.path):
                        stack.append(entry.path)
                elif entry.name.lower().endswith(self.extensions) and self._is_regular(entry):
                    names.append(entry.name)
            found.append((folder, sorted(names)))
        found.sort()
        return [os.path.join(folder, name) for folder, names in found for name in names]

    def _entries(self, folder: str) -> list[os.DirEntry]:
        try:
            with os.scandir(folder) as it:
                return list(it)
        except OSError as e:
            self.problems.append((folder, f"cannot read the folder ({e.strerror or e})"))
            return []

    def _follow_link(self, entry: os.DirEntry) -> bool:
        """Whether to follow the link ``entry``; a reason is listed when it is not followed."""
        target = os.path.realpath(entry.path)
        if not os.path.exists(target):
            reason = f"a broken link (to {target})"
        elif not self.allow_outside_root and os.path.isdir(target):
            reason = "a link to a folder: not followed (allow_outside_root=True follows them)"
        elif not self.allow_outside_root and os.path.commonpath([target, self.real_root]) != self.real_root:
            reason = f"a link out of {self.root} (to {target}): not followed (allow_outside_root=True follows it)"
        else:
            return True
        if entry.name.lower().endswith(self.extensions) or os.path.isdir(target):
            self.problems.append((entry.path, reason))
        return False

    def _first_visit(self, folder: str) -> bool:
        """Whether ``folder`` is seen for the first time (a folder reached again through a link is a loop)."""
        try:
            st = os.stat(folder)
        except OSError as e:
            self.problems.append((folder, f"cannot read the folder ({e.strerror or e})"))
            return False
        key = (st.st_dev, st.st_ino)
        if key in self.visited:
            self.problems.append((folder, "a folder reached a second time through a link (a loop): not read again"))
            return False
        self.visited.add(key)
        return True

    def _is_regular(self, entry: os.DirEntry) -> bool:
        try:
            mode = entry.stat().st_mode
        except OSError as e:
            self.problems.append((entry.path, f"cannot read the file ({e.strerror or e})"))
            return False
        if stat.S_ISREG(mode):
            return True
        kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        self.problems.append((entry.path, f"not a regular file: {kind}"))
        return False


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def walk_folder(
    root: str,
    *,
    allow_outside_root: bool = False,
    extensions: tuple[str, ...] = IMG_EXTENSIONS,
    label_classes: Callable[[list[str]], dict[str, int]] | None = None,
) -> Walked:
    """``root/<class>/**/<image>``: the classes (sub-folder names, sorted), the samples ``(path, label)`` in
    torchvision ``ImageFolder`` order, and what was left out (module docstring). ``label_classes(names)`` gives the
    label of each class found (default: its index in ``names``)."""
    walk = _Walk(root, tuple(e.lower() for e in extensions), allow_outside_root)
    walk._first_visit(root)
    classes = walk.classes()
    if not classes:
        raise MissingFileError(f"{root}: no class folder in it (an ImageFolder holds one folder per class)")
    found = label_classes(classes) if label_classes is not None else {c: i for i, c in enumerate(classes)}
    samples: list[tuple[str, int]] = []
    empty: list[str] = []
    present = set(classes)  # a set: ``in`` a list of 100k class names made the scan quadratic
    for name in sorted(found):
        folder = os.path.join(root, name)
        if name not in present:
            continue
        files = walk.files(folder)
        samples.extend((path, found[name]) for path in files)
        if not files:
            empty.append(name)
    if empty:
        raise MissingFileError(_no_files(root, empty, walk.problems, extensions))
    return Walked(classes, found, samples, walk.problems)


def _no_files(root: str, empty: list[str], problems: list[tuple[str, str]], extensions: tuple[str, ...]) -> str:
    """One line, however many classes are empty: the count, the first few, and what was left out of them."""
    from .._names import escape

    more = f" and {len(empty) - SHOWN} more" if len(empty) > SHOWN else ""
    shown = ", ".join(escape(n) for n in empty[:SHOWN])
    inside = [
        (p, r) for p, r in problems if any(p.startswith(os.path.join(root, n)) for n in empty[:SHOWN])
    ]  # why, when the walk knows
    why = f"; {escape(inside[0][0])}: {inside[0][1]}" if inside else ""
    return (
        f"{root}: no image file in {len(empty)} class folder(s): {shown}{more}{why} "
        f"(image files end in {', '.join(extensions)})"
    )
