"""Helpers shared by the tests (torchvision's ``test/common_utils.py`` habit): tiny image data, devices, and the
backend lists, all derived from the registry so that a new backend is tested where it belongs without editing here.
Fixtures and hooks live in conftest.py."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import gpupipe
from gpupipe import backends

_AVAILABLE = gpupipe.available_backends()

# Every decoding backend usable here that can deliver batches on the CPU (pillow, turbojpeg, DALI's CPU
# pipeline...). DataLoader-worker decoders and DALI alike: the loader contract is the same.
CPU_LOADER_BACKENDS = [b for b in _AVAILABLE if backends.get(b).read is not None and "cpu" in backends.get(b).devices]
# The CPU decoders usable here (one image at a time in DataLoader workers: pillow, pillow-simd, turbojpeg).
DECODERS = [b for b in backends.cpu_decoders() if b in _AVAILABLE]
# The same backends, as the decoders ``read_image`` can use on the CPU side.
READERS = CPU_LOADER_BACKENDS
# The batched GPU decoders usable here (nvjpeg, dali): no per-image CPU decoder, and able to deliver on CUDA.
GPU_DECODERS = [
    b
    for b in _AVAILABLE
    if backends.get(b).read is not None and backends.get(b).decoder is None and "cuda" in backends.get(b).devices
]


def cpu_and_cuda():
    """torchvision's device parametrisation: the CUDA case carries the ``gpu`` marker (skipped without CUDA)."""
    return ("cpu", pytest.param("cuda", marks=pytest.mark.gpu))


# Mean |pixel difference| (in 1/255) that a GPU JPEG decode may add to a comparison with Pillow's: nvJPEG (and DALI's
# "mixed" decoder, which runs it or the hardware decoder) computes the IDCT and upsamples chroma its own way, not as
# libjpeg's default (accurate integer IDCT, "fancy" triangular upsampling). libjpeg-turbo's fast IDCT and plain
# chroma replication (TJFLAG_FASTDCT | TJFLAG_FASTUPSAMPLE) differ from Pillow by 1.15 on average and at most 1.48
# on these tests' photo-like JPEGs (make_folder's and test_dali's, at full size): the CPU tolerance plus this.
GPU_DECODE_SLACK = 1.5


def decode_tolerance(device, cpu: float) -> float:
    """``cpu`` (the bound set with CPU decoders) on the CPU; on CUDA, that plus :data:`GPU_DECODE_SLACK`."""
    return cpu + (GPU_DECODE_SLACK if torch.device(device).type == "cuda" else 0.0)


def same_device(a, b) -> bool:
    """Devices compared by type and index, a bare ``cuda`` being the current GPU (``cuda`` vs ``cuda:0``: the same)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return a.index == b.index or None in (a.index, b.index)
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def photo(rng: np.random.Generator, h: int, w: int) -> Image.Image:
    """A smooth, photo-like image (JPEG-friendly), distinct per rng."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    a = rng.uniform(0, 255, 3)
    b = rng.uniform(0.1, 0.5, 3)
    img = a + 60 * np.sin(x[..., None] * b / 7 + y[..., None] * b[::-1] / 11)
    img += rng.normal(0, 3, img.shape)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")


def make_folder(root, classes: int, per_class: int, seed: int = 0, sizes=((120, 180), (200, 150), (96, 96))):
    """An ImageFolder of ``classes`` x ``per_class`` JPEGs of mixed sizes under ``root``."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        d = root / f"c{c:02d}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            h, w = sizes[(c + i) % len(sizes)]
            photo(rng, h, w).save(d / f"{i:03d}.jpg", quality=90)
    return root


def jpeg_bytes(img, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", **kw)
    return buf.getvalue()


def jpeg_with_orientation(img: Image.Image, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return jpeg_bytes(img, quality=95, exif=exif)


# Unusual but valid files, made from a base image: every decoder gives RGB for each.
VALID = {
    "cmyk": lambda b: jpeg_bytes(b.convert("CMYK"), quality=95),
    "gray": lambda b: jpeg_bytes(b.convert("L"), quality=95),
    "progressive": lambda b: jpeg_bytes(b, quality=95, progressive=True),
    "arithmetic": lambda b: arithmetic_jpeg(jpeg_bytes(b, quality=95)),
    "444": lambda b: jpeg_bytes(b, quality=95, subsampling=0),
    "422": lambda b: jpeg_bytes(b, quality=95, subsampling=1),
    "png_as_jpg": lambda b: encoded(b, "PNG"),
    "webp_as_jpg": lambda b: encoded(b, "WEBP", lossless=True),
    "bmp_as_jpg": lambda b: encoded(b, "BMP"),
    "rgba_png": lambda b: encoded(b.convert("RGBA"), "PNG"),
    "png16": lambda b: encoded(Image.fromarray(np.asarray(b.convert("L")).astype(np.uint16) * 257), "PNG"),
    "tiny": lambda b: jpeg_bytes(b.resize((3, 2)), quality=95),
    "elongated": lambda b: jpeg_bytes(b.resize((400, 8)), quality=95),
}


def arithmetic_jpeg(baseline: bytes) -> bytes:
    """Arithmetic-coded JPEG (Pillow cannot write one): libjpeg-turbo's jpegtran, which `make test` installs."""
    if shutil.which("jpegtran") is None:
        pytest.skip("jpegtran is missing (apt-get install libjpeg-turbo-progs)")
    out = subprocess.run(["jpegtran", "-arithmetic"], input=baseline, capture_output=True, check=True).stdout
    assert out[:2] == b"\xff\xd8" and b"\xff\xc9" in out  # SOF9: arithmetic sequential
    return out


def encoded(img, fmt, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


# Broken files: every decoder raises a DecodeError naming the file.
INVALID = {
    "truncated": lambda b: jpeg_bytes(b, quality=95)[:-400],
    "truncated_in_its_header": lambda b: jpeg_bytes(b, quality=95)[:300],
    "empty": lambda b: b"",
    "not_an_image": lambda b: b"hello, this is text" * 10,
    "corrupt_after_marker": lambda b: jpeg_bytes(b, quality=95)[:200] + bytes(range(256)) * 8,
    "huffman_counts_zeroed": lambda b: huffman_counts_zeroed(jpeg_bytes(b, quality=95)),
}


def huffman_counts_zeroed(data: bytes) -> bytes:
    """A JPEG whose first Huffman table's code counts were overwritten with zeros: PIL opens it, no decoder decodes
    it, and DALI's decoder prints libjpeg's "Bogus marker length" on stderr."""
    from gpupipe.image import _jpeg_segments

    at = next(at for marker, at, _ in _jpeg_segments(data) if marker == 0xC4)
    return data[: at + 1] + bytes(16) + data[at + 17 :]


def float_tiff(path):
    Image.fromarray(np.linspace(0, 1, 64 * 48, dtype=np.float32).reshape(48, 64), "F").save(path, format="TIFF")
    return path


ORIENTED_FORMATS = ("JPEG", "PNG", "WEBP", "TIFF")  # the formats Pillow reads an EXIF orientation from


def with_orientation(img: Image.Image, fmt: str, orientation: int) -> bytes:
    """``img`` stored as ``fmt`` (one of ORIENTED_FORMATS) with an EXIF orientation tag."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encoded(img, fmt, exif=exif, **({"quality": 95} if fmt in ("JPEG", "WEBP") else {}))


def exif_upright(data: bytes) -> Image.Image:
    from PIL import ImageOps

    return ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")  # turned as opened, then converted


REPO_ROOT = Path(__file__).resolve().parents[1]


def gpupipe_cli(*args, **kw):
    """``python -m gpupipe ...`` as a user runs it, output to pipes (not a terminal)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **kw.pop("env", {})}
    return subprocess.run(
        [sys.executable, "-m", "gpupipe", *map(str, args)], capture_output=True, text=True, env=env, timeout=600, **kw
    )


def ctrl_c_mid_pass(script: str, data, *, ignored: bool = False, after: float = 0.3) -> tuple[int, str, str]:
    """``python -c script data`` in a session of its own (SIGINT ignored from its start, as ``nohup`` starts one,
    where ``ignored``), sent a Ctrl-C as a terminal sends one, to its whole process group, ``after`` seconds past its
    line "in the second pass": its exit status, and what it printed after that line, and on stderr."""
    import signal

    run = subprocess.Popen(
        [sys.executable, "-c", script, str(data)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignored else None,
    )
    try:
        assert run.stdout is not None and run.stdout.readline() == "in the second pass\n"
        time.sleep(after)
        os.killpg(run.pid, signal.SIGINT)
        out, err = run.communicate(timeout=120)
    finally:
        run.kill()
    return run.returncode, out, err


def assert_resume_is_exact(make_loader, epoch: int, batch: int) -> None:
    """A loader resumed at ``(epoch, batch)`` by ``load_state_dict`` delivers exactly the rest of a straight epoch:
    the same images and labels, to the bit."""
    straight = make_loader()
    straight.set_epoch(epoch)
    whole = list(straight)
    resumed = make_loader()
    resumed.load_state_dict({"epoch": epoch, "batch": batch})
    rest = list(resumed)
    assert len(rest) == len(whole) - batch
    for (a, la), (b, lb) in zip(whole[batch:], rest, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)


def two_rank_epochs(root, backend: str) -> tuple[list[int], list[set[int]]]:
    """Steps and label sets of ranks 0 and 1 of a train loader over ``root`` (batch 3, one epoch)."""
    steps, seen = [], []
    for rank in range(2):
        loader = gpupipe.build_loader(
            root,
            backend,
            batch_size=3,
            train=True,
            image_size=24,
            num_workers=0,
            rank=rank,
            world_size=2,
            drop_last=False,
            device="cpu",
        )
        labels = [y for _, y in loader]
        steps.append(len(labels))
        seen.append(set(torch.cat(labels).tolist()))
    return steps, seen


def on_two_gloo_ranks(work, *args, timeout: float = 120.0) -> dict:
    """``work(*args)`` on each of two gloo ranks, forked processes in one process group: rank -> what it returned.
    The group's store is a file (no port to pick and lose to another process before rank 0 binds it), and a barrier
    holds every rank until its peer has connected: a rank that leaves straight after ``init_process_group`` can close
    its side while the peer still connects ("Connection closed by peer", 1 in 150 on a busy 2-core machine). A rank
    that dies fails the test at once, with its exit code."""
    import datetime
    import multiprocessing
    import queue
    import tempfile

    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = f"file://{tmp}/store"

        def rank_main(rank: int) -> None:
            dist = torch.distributed
            dist.init_process_group(
                "gloo", init_method=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=timeout)
            )
            try:
                dist.barrier()
                out.put((rank, work(*args)))
            finally:
                dist.destroy_process_group()

        procs = [ctx.Process(target=rank_main, args=(r,)) for r in range(2)]
        for p in procs:
            p.start()
        results: dict = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) < len(procs):
                try:
                    rank, got = out.get(timeout=0.5)
                    results[rank] = got
                except queue.Empty:
                    codes = [p.exitcode for p in procs]
                    failed = any(c not in (None, 0) for c in codes)
                    assert not failed and time.monotonic() < deadline, f"the ranks' exit codes: {codes}"
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
                    p.join()
    return results


# A quick CPU training run (tests/test_train*.py, tests/probe.py): a tiny timm model on 32-pixel images.
QUICK_TRAIN = {"model": "test_resnet", "epochs": 2, "image_size": 32, "workers": 0, "device": "cpu", "lr": 0.05}


SHUTDOWN_SEEN = "gpupipe-test: a rank went through the interpreter's shutdown"


def shutdown_watch(folder: Path) -> str:
    """A ``PYTHONPATH`` entry whose ``sitecustomize`` prints ``SHUTDOWN_SEEN`` to stderr from an ``atexit`` hook in
    every process that imported gpupipe (the ranks, not torchrun's launcher): a gloo DDP rank that reaches the
    interpreter's shutdown can abort there, now and then (see docs/frameworks.md), so the examples leave before it."""
    folder.mkdir(parents=True, exist_ok=True)
    hook = f"lambda: 'gpupipe' in sys.modules and print({SHUTDOWN_SEEN!r}, file=sys.stderr, flush=True)"
    (folder / "sitecustomize.py").write_text(f"import atexit, sys\natexit.register({hook})\n")
    return str(folder)


def train_args(data, out, *extra: str, **overrides) -> list[str]:
    """``gpupipe train`` arguments for a quick run on ``data`` into ``out``: ``QUICK_TRAIN`` (batches of 4) with
    ``overrides`` by field name (``True``: a bare flag; ``None``: left out, the default), then ``extra`` as given."""
    settings = {"data": data, "out": out, **QUICK_TRAIN, "batch_size": 4, **overrides}
    args: list[str] = []
    for name, value in settings.items():
        if value is None or value is False:
            continue
        args.append("--" + name.replace("_", "-"))
        if value is not True:
            args.append(str(value))
    return [*args, *extra]


def train_cli(data, out, *extra: str, **overrides) -> list[str]:
    """``python -m gpupipe train ...`` with ``train_args``: the command a subprocess runs."""
    return [sys.executable, "-m", "gpupipe", "train", *train_args(data, out, *extra, **overrides)]


def killed_at_first_checkpoint(cmd: list[str], out: Path) -> Path:
    """Run the training command ``cmd`` (writing to ``out``), SIGKILL it once its first checkpoint exists (or once it
    ended by itself: a 300 s hang guard, not a timing margin); the checkpoint's path."""
    import signal
    import time

    proc = subprocess.Popen(cmd)
    ckpt = Path(out) / "checkpoints" / "last.pt"
    deadline = time.time() + 300
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return ckpt


def train_config(data, out, **overrides):
    """The ``TrainConfig`` of a quick in-process run (batches of 8, half an epoch of warm-up, progress every batch)
    with ``overrides``."""
    from gpupipe.train.config import TrainConfig

    base = {**QUICK_TRAIN, "batch_size": 8, "warmup_epochs": 0.5, "log_every": 1}
    return TrainConfig(**{**base, "data": str(data), "out": str(out), **overrides})


class S3Server:
    """A real S3-compatible server (moto's server mode) on 127.0.0.1, and an s3fs client to fill it: a thread of
    this process (``ThreadedMotoServer``), or with ``process=True`` a ``moto_server`` process of its own, whose
    :meth:`stop` kills it and every connection to it, as a server that goes down does."""

    BUCKET = "gpupipe-test"

    def __init__(self, process: bool = False):
        import logging
        import socket

        self.process: subprocess.Popen | None = None
        if process:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            self.process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            self.endpoint = f"http://127.0.0.1:{port}"
            self._wait_until_up()
            self.client().mkdir(self.BUCKET)
            return
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"

    def _wait_until_up(self, timeout: float = 60) -> None:
        import time
        import urllib.request

        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def client(self):
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=self.endpoint)

    def upload(self, local: Path, prefix: str) -> str:
        """Every file under ``local`` (or the file itself) to ``s3://BUCKET/prefix/...``; returns that URL."""
        fs = self.client()
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        for p in files:
            rel = p.name if local.is_file() else p.relative_to(local).as_posix()
            fs.put_file(str(p), f"{self.BUCKET}/{prefix}/{rel}")
        return f"s3://{self.BUCKET}/{prefix}"

    def set_auth(self, enforced: bool) -> None:
        """With ``enforced``, moto checks credentials against its IAM (empty): every request is refused (403)."""
        import urllib.request

        body = b"0" if enforced else b"inf"
        request = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", body, {"Content-Type": "text/plain"})
        urllib.request.urlopen(request)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
        else:
            self.server.stop()


class HTTPFiles:
    """A real HTTP server on 127.0.0.1 (a thread of this process) that serves the files under ``root`` with range
    requests, as a static web server does, and as S3 does for a path-style GET (``/bucket/key``). ``fail(status,
    body)`` queues answers given before any file (a 500, a 503 SlowDown); ``late`` seconds pass before each answer;
    ``requests`` lists the paths asked."""

    def __init__(self, root: Path):
        import http.server
        import threading

        self.root, self.requests, self.faults, self.late = Path(root), [], [], 0.0
        files = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                files._answer(self, body=True)

            def do_HEAD(self):
                files._answer(self, body=False)

            def log_message(self, *args):  # quiet
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def fail(self, status: int, body: bytes = b"") -> None:
        self.faults.append((status, body))

    def _answer(self, h, body: bool) -> None:
        path = h.path.split("?")[0]
        self.requests.append(path)
        time.sleep(self.late)
        status, data, headers = self._reply(path, h.headers.get("Range"))
        h.send_response(status)
        for k, v in {**headers, "Content-Length": str(len(data))}.items():
            h.send_header(k, v)
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _reply(self, path: str, ranged: str | None) -> tuple[int, bytes, dict[str, str]]:
        if self.faults:
            status, text = self.faults.pop(0)
            return status, text, {"Content-Type": "application/xml"}
        file = self.root / path.lstrip("/")
        if not file.is_file():
            return 404, b"", {}
        data = file.read_bytes()
        if ranged is None:
            return 200, data, {"Accept-Ranges": "bytes"}
        start, _, end = ranged.removeprefix("bytes=").partition("-")
        first, last = int(start), min(int(end) if end else len(data) - 1, len(data) - 1)
        return 206, data[first : last + 1], {"Content-Range": f"bytes {first}-{last}/{len(data)}"}

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class BlackHole:
    """A TCP server on 127.0.0.1 that accepts every connection and never answers (nor closes it): an endpoint that
    hangs, as a stuck proxy or a half-dead server does."""

    def __init__(self):
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:  # closed
                return

    def stop(self) -> None:
        self.sock.close()
        for s in self.held:
            s.close()


class CountingProxy:
    """An HTTP proxy on 127.0.0.1 in front of ``upstream`` (an S3 server) that counts, per request ``(method,
    path)``, the requests and the body bytes answered (``log``: each in order, with its Range): what a store is asked,
    seen from the server's side. A GET of a
    path in ``stall`` answers half its body, sets ``stalled`` and waits for ``release`` (a fetch cut mid-way)."""

    def __init__(self, upstream: str):
        import collections
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlsplit

        host, port = urlsplit(upstream).hostname, urlsplit(upstream).port
        self.requests: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()
        self.log: list[tuple[str, str, str | None, int]] = []  # (method, path, Range, bytes answered), in order
        self.stall: set[str] = set()
        self.stalled, self.release = threading.Event(), threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                conn = http.client.HTTPConnection(host, port, timeout=60)
                conn.request(self.command, self.path, body, dict(self.headers.items()))
                answer = conn.getresponse()
                data = answer.read()
                conn.close()
                path = self.path.split("?")[0]
                proxy.requests[self.command, path] += 1
                proxy.bytes[self.command, path] += len(data)
                proxy.log.append((self.command, path, self.headers.get("Range"), len(data)))
                self.send_response(answer.status)
                for k, v in answer.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                length = answer.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))  # a HEAD's: the object's
                self.end_headers()
                if self.command == "HEAD":
                    return
                if self.command == "GET" and path in proxy.stall:
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    proxy.stalled.set()
                    proxy.release.wait(60)
                    self.close_connection = True
                    return
                self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def gets(self, prefix: str) -> dict[str, int]:
        """GET requests per object path under ``/BUCKET/prefix/``."""
        return {p: n for (m, p), n in self.requests.items() if m == "GET" and p.startswith(prefix)}

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
