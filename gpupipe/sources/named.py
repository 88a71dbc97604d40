"""A dataset object named by a string, as a command line names one (``gpupipe train --data``, ``check``,
``prepare``): ``module:callable`` (the callable's result) or ``module.Class:ROOT`` (``Class(ROOT)``, as
``torchvision.datasets.CIFAR10:data/cifar``)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re

_NAMED = re.compile(r"^(?P<left>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<right>.*)$")


def is_named_dataset(data: str) -> bool:
    """``data`` reads as ``dotted.name:rest``, is no URL (``s3://...``) and no path that exists."""
    return _NAMED.match(data) is not None and "://" not in data and not os.path.exists(data)


def open_named(data: str) -> object:
    """The dataset ``data`` names: ``module:callable`` calls ``callable()`` of the importable ``module``;
    ``module.Attr:ARG`` calls ``Attr(ARG)``. One line naming ``data`` when it cannot be imported or called."""
    match = _NAMED.match(data)
    if match is None:
        raise ValueError(f"{data}: expected module:callable or module.Class:ROOT")
    left, right = match["left"], match["right"]
    try:
        if _is_module(left):
            if not right.isidentifier():
                raise ValueError(f"{right!r} is not a name in module {left}")
            return getattr(importlib.import_module(left), right)()
        module, _, attr = left.rpartition(".")
        if not module or not _is_module(module):
            raise ValueError(f"no module {module or left} to import")
        return getattr(importlib.import_module(module), attr)(right)
    except Exception as e:  # an import error, a missing name, the dataset's own refusal (no files at ROOT)
        raise ValueError(
            f"{data}: cannot make the dataset ({type(e).__name__}: {e}); expected module:callable "
            "or module.Class:ROOT, e.g. torchvision.datasets.CIFAR10:data/cifar"
        ) from None


def resolved(data: str) -> str:
    """``--data`` as a resumed run compares it: a path resolved (the run may resume from another folder), a dataset's
    name as written."""
    return data if is_named_dataset(data) else os.path.realpath(data)


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent that is no package
        return False
