"""Issue 52: gpupipe's DALI graph beside DALI's reference graph, and each one's decode alone, on the same photos in
memory (bench/README.md, "Where a DALI thread's time goes").

Four CPU graphs, each fed the same encoded photos in the same order, a batch at a time, through one pipeline of
``--threads`` DALI threads (no files read, no loader around them):

- ``gpupipe``: the dali backend's own train graph (:func:`gpupipe.backends.dali_graph.build_pipeline`), fed the
  recipe's crop boxes as the loader feeds them: ``decoders.image_slice`` -> ``resize`` -> ``crop_mirror_normalize``;
- ``gpupipe-decode``: its ``decoders.image_slice`` alone, the same boxes;
- ``reference``: DALI's documented graph: ``decoders.image_random_crop`` -> ``resize`` -> ``crop_mirror_normalize``
  (its own boxes, drawn with the same scale and ratio ranges);
- ``reference-decode``: its ``decoders.image_random_crop`` alone;
- ``image_crop``: gpupipe's graph with ``decoders.image_crop`` in place of ``decoders.image_slice``, the same windows
  (the same pixels: DALI places its window at ``roundf(position * (size - window))``);
- ``image_crop-decode``: its ``decoders.image_crop`` alone.

Interleaved rounds; the median images per second of the rounds. ``decode share``: a graph's time per image spent in
its decoder (its decode-alone rate over the whole graph's).

    python bench/dali_graphs.py data/photos-large --batch 8 --rounds 5 --json bench/results/dali-graphs-X.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from gpupipe.backends.dali import dali_info
from gpupipe.backends.dali_graph import build_pipeline, crop_inputs
from gpupipe.bench.report import cpu_times, others_share
from gpupipe.info import source_commit
from gpupipe.recipe import Recipe
from gpupipe.sources.open import open_source

SIZE = 224


def _reference(batch: int, threads: int, decode_only: bool):
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=None, prefetch_queue_depth=1, seed=0)
    def pipe():
        enc = fn.external_source(name="enc", dtype=types.UINT8, ndim=1, no_copy=True)
        images = fn.decoders.image_random_crop(
            enc, device="cpu", output_type=types.RGB, random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3]
        )
        if decode_only:
            return images
        images = fn.resize(images, resize_x=SIZE, resize_y=SIZE)
        mirror = fn.random.coin_flip(probability=0.5)
        return fn.crop_mirror_normalize(images, dtype=types.UINT8, output_layout="CHW", mirror=mirror)

    p = pipe()
    p.build()
    return p


def _decode_slice(batch: int, threads: int):
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=None, prefetch_queue_depth=1)
    def pipe():
        enc = fn.external_source(name="enc", dtype=types.UINT8, ndim=1, no_copy=True)
        anchor = fn.external_source(name="anchor", dtype=types.INT64, ndim=1)
        shape = fn.external_source(name="shape", dtype=types.INT64, ndim=1)
        return fn.decoders.image_slice(
            enc,
            anchor,
            shape,
            device="cpu",
            output_type=types.RGB,
            axis_names="HW",
            normalized_anchor=False,
            normalized_shape=False,
        )

    p = pipe()
    p.build()
    return p


def _decode_crop(batch: int, threads: int):
    """The same windows through ``decoders.image_crop`` (its size and normalised position per sample): DALI places
    the window at ``roundf(position * (size - window))``, so the pixels are image_slice's."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=None, prefetch_queue_depth=1)
    def pipe():
        enc = fn.external_source(name="enc", dtype=types.UINT8, ndim=1, no_copy=True)
        window = {name: fn.external_source(name=name, dtype=types.FLOAT, ndim=0) for name in _CROP_ARGS}
        return fn.decoders.image_crop(enc, device="cpu", output_type=types.RGB, **window)

    p = pipe()
    p.build()
    return p


def _crop_graph(batch: int, threads: int):
    """gpupipe's train graph (:func:`gpupipe.backends.dali_graph.build_pipeline`) with its windows decoded by
    ``decoders.image_crop``: the rest (resize to the fed side, mirror where fed) as there."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=None, prefetch_queue_depth=1, exec_dynamic=True)
    def pipe():
        enc = fn.external_source(name="enc", dtype=types.UINT8, ndim=1, no_copy=True)
        window = {name: fn.external_source(name=name, dtype=types.FLOAT, ndim=0) for name in _CROP_ARGS}
        flip = fn.external_source(name="flip", dtype=types.INT32, ndim=0)
        side = fn.external_source(name="side", dtype=types.FLOAT, ndim=0)
        images = fn.decoders.image_crop(enc, device="cpu", output_type=types.RGB, **window)
        images = fn.resize(images, resize_x=side, resize_y=side, antialias=True, interp_type=types.INTERP_LINEAR)
        return fn.crop_mirror_normalize(images, dtype=types.UINT8, output_layout="CHW", mirror=flip)

    p = pipe()
    p.build()
    return p


_CROP_ARGS = ("crop_w", "crop_h", "crop_pos_x", "crop_pos_y")


def crop_args(boxes: np.ndarray, heights: np.ndarray, widths: np.ndarray) -> dict[str, np.ndarray]:
    """``decoders.image_crop``'s arguments for (top, left, height, width) ``boxes`` of images of these sizes."""
    top, left, h, w = (boxes[:, k] for k in range(4))
    free_y, free_x = heights - h, widths - w
    return {
        "crop_w": w.astype(np.float32),
        "crop_h": h.astype(np.float32),
        "crop_pos_x": np.where(free_x > 0, left / np.maximum(free_x, 1), 0).astype(np.float32),
        "crop_pos_y": np.where(free_y > 0, top / np.maximum(free_y, 1), 0).astype(np.float32),
    }


def graphs(datas: list[np.ndarray], batch: int, threads: int) -> dict[str, Callable[[list[dict] | None], np.ndarray]]:
    """Each graph: a call that runs every batch of ``datas`` through it once, fed the crop inputs given (the gpupipe
    graphs), and returns each output's (height, width)."""
    import torch

    ours = build_pipeline(Recipe(SIZE), train=True, batch_size=batch, device=torch.device("cpu"), num_threads=threads)

    def runner(p, names: tuple[str, ...]) -> Callable[[list[dict] | None], np.ndarray]:
        def run(inputs: list[dict] | None) -> np.ndarray:
            shapes = []
            for k in range(len(datas) // batch):
                p.feed_input("enc", datas[k * batch : (k + 1) * batch])
                for name in names:
                    p.feed_input(name, inputs[k][name])
                (out,) = p.run()[:1]
                shapes.extend(s[:2] for s in out.shape())
            return np.array(shapes, np.int64)

        return run

    return {
        "gpupipe": runner(ours, ("anchor", "shape", "flip", "side")),
        "gpupipe-decode": runner(_decode_slice(batch, threads), ("anchor", "shape")),
        "image_crop": runner(_crop_graph(batch, threads), (*_CROP_ARGS, "flip", "side")),
        "image_crop-decode": runner(_decode_crop(batch, threads), _CROP_ARGS),
        "reference": runner(_reference(batch, threads, decode_only=False), ()),
        "reference-decode": runner(_reference(batch, threads, decode_only=True), ()),
    }


class Photos:
    """``count`` photos of a folder (repeated where it has fewer) in memory, their sizes, and the recipe's train boxes
    of an epoch as the dali graph's crop inputs."""

    def __init__(self, data: Path, count: int, batch: int):
        from PIL import Image

        source = open_source(str(data))
        if not source.reads_files or not len(source):
            raise SystemExit(f"error: {data}: not a folder of image files")
        self.batch, self.recipe = batch, Recipe(SIZE)
        self.order = np.arange(count // batch * batch) % len(source)
        self.datas = [np.frombuffer(source.read(int(i)), np.uint8) for i in self.order]
        sizes = {}
        for i in set(self.order.tolist()):
            with Image.open(source.samples[i][0]) as im:  # upright, as DALI decodes it (and the recipe's boxes are)
                turned = im.getexif().get(0x0112, 1) in (5, 6, 7, 8)
                sizes[i] = (im.width, im.height) if turned else (im.height, im.width)
        self.heights = np.array([sizes[i][0] for i in self.order], np.int64)
        self.widths = np.array([sizes[i][1] for i in self.order], np.int64)
        self.distinct = len(sizes)

    def inputs(self, epoch: int) -> tuple[list[dict], np.ndarray]:
        """The crop inputs of each batch, the recipe's boxes of ``epoch``, and the boxes' areas (of their images')."""
        boxes = self.recipe.plan_boxes(True, 0, epoch, self.order, self.heights, self.widths)
        rows = np.empty((len(self.order), 6), np.int64)
        rows[:, :5], rows[:, 5] = boxes, SIZE
        window = crop_args(boxes, self.heights, self.widths)
        batches = []
        for k in range(0, len(rows), self.batch):
            fed = crop_inputs(self.recipe, True, rows[k : k + self.batch])
            batches.append(fed | {name: column[k : k + self.batch] for name, column in window.items()})
        return batches, self.areas(boxes[:, 2:4])

    def areas(self, shapes: np.ndarray) -> np.ndarray:
        return shapes[:, 0] * shapes[:, 1] / (self.heights * self.widths)


def same_windows(photos: Photos, threads: int) -> bool:
    """Whether ``image_crop`` decodes, pixel for pixel, the windows ``image_slice`` does (every photo, one epoch)."""
    sliced, cropped = _decode_slice(photos.batch, threads), _decode_crop(photos.batch, threads)
    for k, fed in enumerate(photos.inputs(0)[0]):
        outs = []
        for p, names in ((sliced, ("anchor", "shape")), (cropped, _CROP_ARGS)):
            p.feed_input("enc", photos.datas[k * photos.batch : (k + 1) * photos.batch])
            for name in names:
                p.feed_input(name, fed[name])
            outs.append(p.run()[0])
        if not all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(*(list(o) for o in outs), strict=True)):
            return False
    return True


def timed(photos: Photos, threads: int, rounds: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each graph's images per second in each round, and the crop areas each drew."""
    runs = graphs(photos.datas, photos.batch, threads)
    for name, run in runs.items():  # warm: DALI's buffers grown to the largest batch
        run(None if name.startswith("reference") else photos.inputs(0)[0])
    rates: dict[str, list[float]] = {k: [] for k in runs}
    areas: dict[str, list[float]] = {"gpupipe": [], "reference": []}
    for r in range(rounds):
        inputs, drawn = photos.inputs(r + 1)  # each round its own draw, as the reference draws its own
        areas["gpupipe"].extend(drawn.tolist())
        for name in list(runs)[r % len(runs) :] + list(runs)[: r % len(runs)]:  # the order rotated
            t0 = time.perf_counter()
            shapes = runs[name](inputs)
            rates[name].append(len(photos.order) / (time.perf_counter() - t0))
            if name == "reference-decode":  # the boxes it drew: the decoded windows' sizes
                areas["reference"].extend(photos.areas(shapes).tolist())
    return rates, areas


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", type=Path)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--count", type=int, default=240, help="photos per round (whole batches; repeated if fewer)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    photos = Photos(args.data, args.count, args.batch)
    since = cpu_times()
    rates, drawn = timed(photos, args.threads, args.rounds)
    others = others_share(since, cpu_times())
    median = {k: statistics.median(v) for k, v in rates.items()}
    rows = []
    for name, v in rates.items():
        row = {"graph": name, "images_per_s": median[name], "min": min(v), "max": max(v), "rounds": v}
        if f"{name}-decode" in median:
            row["decode_share"] = median[name] / median[f"{name}-decode"]
        rows.append(row)
        share = f"  decode share {row['decode_share']:.0%}" if "decode_share" in row else ""
        print(f"{name:17s} {median[name]:7.1f} img/s  ({min(v):.1f}-{max(v):.1f}){share}")
    ratio = median["gpupipe"] / median["reference"]
    crop_ratio = median["image_crop"] / median["gpupipe"]
    same = same_windows(photos, args.threads)
    print(f"image_crop decodes image_slice's pixels: {same}; its graph / gpupipe's: {crop_ratio:.3f}x")
    area = {k: float(np.mean(v)) for k, v in drawn.items()}
    print(f"gpupipe / reference: {ratio:.3f}x; mean crop area: {', '.join(f'{k} {v:.3f}' for k, v in area.items())}")
    if args.json:
        meta = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": source_commit(),
            "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "dali": dali_info()["package"],
            "photos": f"{len(photos.order)} a round, {photos.distinct} distinct, from {args.data}",
            "batch": args.batch,
            "threads": args.threads,
            "others_cpu_share": others,
            "command": f"python bench/dali_graphs.py {args.data} --batch {args.batch} --threads {args.threads} "
            f"--count {args.count} --rounds {args.rounds}",
        }
        report = {"meta": meta, "rows": rows, "gpupipe_vs_reference": ratio, "mean_crop_area": area}
        report["image_crop_same_pixels"] = same
        report["image_crop_vs_gpupipe"] = crop_ratio
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
