"""The one thing pyproject.toml cannot say without an experimental table: the turbojpeg backend's window decode
(gpupipe/_jpeg_window.c), against libjpeg-turbo's libjpeg API. It is built where a C compiler and libjpeg-turbo's
headers are (`make setup` installs libjpeg-dev), else left out: the whole image is decoded then, with the same pixels.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("gpupipe._jpeg_window", ["gpupipe/_jpeg_window.c"], libraries=["jpeg"], optional=True)])
