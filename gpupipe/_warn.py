"""Warnings to the user, pointed at the user's own line: the first frame outside gpupipe (a ``build_loader`` call),
however deep inside the package they are raised (a fixed ``stacklevel`` names a gpupipe file once a call moves)."""

from __future__ import annotations

import os
import sys
import types
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first caller outside gpupipe."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 2  # warn_user's caller
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
