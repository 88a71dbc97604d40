"""The one place the version is written: pyproject.toml reads it (``[tool.setuptools.dynamic]``), so does ``gpupipe
--version``. Not importlib.metadata: an unrelated distribution named gpupipe exists on the package index, and a
source tree run without installing has no metadata at all."""

__version__ = "0.1.0"
