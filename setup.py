"""What pyproject.toml cannot say without an experimental table: the package's two C extensions, each built where it
can be, else left out.

- gpupipe/_jpeg_window.c: the turbojpeg backend's window decode, against libjpeg-turbo's libjpeg API. Built where a C
  compiler and libjpeg-turbo's headers are (`make setup` installs libjpeg-dev); without it the whole image is
  decoded, with the same pixels.
- gpupipe/_stamps.c: the dali backend's check of a batch's files once a pass, without the GIL. Needs a C compiler
  alone; without it the header-scan processes are asked, a few batches to a message.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("gpupipe._jpeg_window", ["gpupipe/_jpeg_window.c"], libraries=["jpeg"], optional=True),
        Extension("gpupipe._stamps", ["gpupipe/_stamps.c"], optional=True),
    ]
)
