"""gpupipe/train/config.py: defaults <- YAML <- flags, one-line errors, ``--help`` for every field."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpupipe.train.config import TrainConfig, load_config

from .common_utils import REPO_ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def test_config_file_overrides_only_what_it_names(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("epochs: 3\nprecision: bf16\n")
    cfg = load_config(str(f), {"lr": 0.5, "model": None})
    assert (cfg.epochs, cfg.precision, cfg.lr, cfg.model) == (3, "bf16", 0.5, TrainConfig.model)
    f.write_text("epocs: 3\n")
    with pytest.raises(Exception, match="epocs"):
        load_config(str(f))
    with pytest.raises(ValueError, match="precision"):
        TrainConfig(precision="fp8")


def test_help_explains_every_flag_and_booleans_turn_off(tmp_path, capsys):
    from dataclasses import fields

    from gpupipe.cli import main
    from gpupipe.train.config import HELP

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert {f.name for f in fields(TrainConfig)} == HELP.keys()
    for name in HELP:
        assert f"--{name.replace('_', '-')}" in text
    for choices in ("{fp32,bf16,fp16}", "{sgd,adamw}", "{raise,skip}", "{auto,pillow,"):
        assert choices in text
    assert "--no-channels-last" in text and "(default None: the rank's share of the usable cores" in text
    f = tmp_path / "run.yaml"
    f.write_text("channels_last: true\ncompile: true\n")
    assert main(["train", "--config", str(f), "--no-channels-last", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "channels_last: false" in printed and "compile: true" in printed


def test_each_field_carries_its_help_resume_rule_and_choices(tmp_path):
    from dataclasses import fields

    from gpupipe.train.config import CHOICES, RESUME_CHANGEABLE, RESUME_FIXED

    for f in fields(TrainConfig):
        assert f.metadata["help"] and f.metadata["resume"] in ("fixed", "changeable", None), f.name
    assert {"data", "model", "batch_size", "accum", "seed"} <= set(RESUME_FIXED)
    assert {"epochs", "lr", "precision", "backend"} <= set(RESUME_CHANGEABLE)
    assert not set(RESUME_FIXED) & set(RESUME_CHANGEABLE) and "out" not in RESUME_FIXED + RESUME_CHANGEABLE
    assert CHOICES["remode"] == ("pixel", "rand", "const") and "backend" not in CHOICES  # backend: the registry's
    f = tmp_path / "c.yaml"
    f.write_text("lr: 0.1\nremode: noise\n")
    with pytest.raises(ValueError, match=r"c\.yaml:2: remode must be one of pixel, rand, const, got 'noise'"):
        load_config(str(f))
    with pytest.raises(ValueError, match="on_error must be one of raise, skip"):
        TrainConfig(on_error="ignore")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--log-every", "0"], "error: --log-every must be >= 1, got 0"),  # the flag given, not the key
        (["--lr", "nan"], "error: --lr must be a number, got nan"),
        (["--lr", "inf"], "error: --lr must be a finite number >= 0, got inf"),
        (["--momentum", "nan"], "error: --momentum must be a number, got nan"),
    ],
)
def test_values_that_would_fail_later_are_refused_up_front(tmp_path, capsys, flags, said):
    from gpupipe.cli import main

    assert main(["train", "--out", str(tmp_path / "run"), *flags, "--print-config"]) != 0
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err


def test_the_resolution_schedule_flags(capsys):
    """--res-start/--res-end/--res-start-epoch/--res-end-epoch/--eval-size in --help; sizes on the step are used
    exactly; the ends default to --image-size and the last epoch; bad values are one line."""
    from gpupipe.cli import main
    from gpupipe.recipe import ResolutionSchedule

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--res-start RES_START", "--res-end RES_END", "--res-start-epoch", "--res-end-epoch", "--eval-size"):
        assert flag in text
    cfg = load_config(None, {"res_start": 160, "res_end": 192, "res_start_epoch": 2, "res_end_epoch": 13})
    assert cfg.train_size() == ResolutionSchedule(160, 192, 2, 13, 32)
    assert [cfg.train_size().at(e) for e in (0, 2, 12, 13)] == [160, 160, 160, 192]  # type: ignore[union-attr]
    assert TrainConfig(res_start=128, epochs=5).train_size() == ResolutionSchedule(128, 224, 0, 4, 32)
    assert TrainConfig(image_size=192).train_size() == 192
    for bad, match in (
        ({"res_start": 0}, "res_start must be >= 1"),
        ({"res_start": 128, "res_start_epoch": 3, "res_end_epoch": 1}, "--res-end-epoch 1 must come after"),
        ({"eval_size": -1}, "eval_size must be >= 1"),
    ):
        with pytest.raises(ValueError, match=match):
            TrainConfig(**bad)


def test_schedule_flags_that_contradict_each_other_or_do_nothing_are_refused_in_one_line():
    """--res-start-epoch 1 --res-end-epoch 1 (the last epoch at --res-start is also the first at --res-end), and the
    schedule's epochs without a schedule (no --res-start, no --res-end), were accepted and ignored."""
    for bad, said in (
        (
            {"res_start": 128, "res_start_epoch": 1, "res_end_epoch": 1},
            "--res-end-epoch 1 must come after --res-start-epoch 1: that is the last epoch at --res-start, "
            "--res-end-epoch the first at --res-end (e.g. --res-end-epoch 2)",
        ),
        (
            {"res_start_epoch": 1},
            "--res-start-epoch 1: the resolution schedule is off without --res-start or --res-end; set one, or drop it",
        ),
        ({"res_end_epoch": 4, "res_step": 16}, "--res-end-epoch 4, --res-step 16: the resolution schedule is off"),
    ):
        with pytest.raises(ValueError) as e:
            TrainConfig(**bad)
        assert str(e.value).startswith(said) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (
            {"res_start": 96, "res_start_epoch": 5, "epochs": 2},
            "the resolution schedule reaches --res-end 224 at epoch 6, but --epochs 2 ends after epoch 1 (epochs count "
            "from 0), at side 96: to finish it, resume with --allow-config-change --epochs 7",
        ),
        (
            {"res_end": 160, "res_end_epoch": 50, "epochs": 3},
            "the resolution schedule reaches --res-end 160 at epoch 50, but --epochs 3 ends after epoch 2 (epochs "
            "count from 0), at side 192: to finish it, resume with --allow-config-change --epochs 51",
        ),
        (
            {"res_end": 288, "epochs": 1},
            "the resolution schedule reaches --res-end 288 at epoch 1, but --epochs 1 ends after epoch 0",
        ),
    ],
)
def test_a_schedule_that_cannot_finish_within_the_epochs_is_said_in_one_line(flags, said, caplog):
    """It trained to the end at the start size, silently. A warning, not a refusal: --epochs may be extended on
    resume, and the line says how; said once however often the config is made again."""
    with caplog.at_level("WARNING", logger="gpupipe"):
        TrainConfig(**flags)
        TrainConfig(**flags)
    lines = [r.getMessage() for r in caplog.records if r.name == "gpupipe"]
    assert len(lines) == 1 and lines[0].startswith(said) and "\n" not in lines[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="gpupipe"):  # the schedule done within the run: nothing to say
        TrainConfig(**{**flags, "epochs": 60})
    assert not caplog.records


@pytest.mark.slow
def test_a_value_the_file_sets_out_of_range_is_named_by_its_line(tmp_path):
    """The probe: ``lr: -1`` in a config file was ``lr must be a finite number >= 0, got -1.0``, naming neither the
    file nor the line (an unknown key or a wrong type named both)."""
    f = tmp_path / "c.yaml"
    f.write_text("data: data/sample\nlr: -1\n")
    with pytest.raises(ValueError, match=r"^\S*c\.yaml:2: lr must be a finite number >= 0, got -1.0$"):
        load_config(str(f))
    with pytest.raises(ValueError, match=r"^lr must be a finite number >= 0, got -2.0$"):  # the flag's: cli names it
        load_config(str(f), {"lr": -2.0})


def test_under_torchrun_rank_0_alone_says_a_config_warning():
    """Every rank printed the same config warning (and every other ``gpupipe`` log line): rank 0 now speaks for all."""
    flags = ["-m", "gpupipe", "train", "--print-config", "--res-end", "288", "--epochs", "1"]
    said = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO_ROOT),
            "WORLD_SIZE": "2",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
        }
        out = subprocess.run([sys.executable, *flags], capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        said.append("the resolution schedule reaches --res-end 288" in out.stdout + out.stderr)
    assert said == [True, False]


def test_the_cache_limit_is_parsed_and_said_when_it_has_no_effect(caplog):
    """--cache-limit banana trained normally (parsed only when a loader over a URL was built); --cache-limit 1GB over
    a local folder said nothing."""
    with pytest.raises(ValueError) as e:
        TrainConfig(data="s3://bucket/train", cache_limit="banana")
    assert str(e.value) == (
        "--cache-limit 'banana': expected bytes or a size such as 50GB, 512MiB or 100k (powers of 1024), or 0 for no "
        "cache folder"
    )
    with caplog.at_level("WARNING", logger="gpupipe"):
        TrainConfig(data="s3://bucket/train", cache_limit="3GB")
        assert not caplog.records
        TrainConfig(data="my/folder", cache_limit="1GB")
    assert [r.getMessage() for r in caplog.records] == [
        "--cache-limit 1GB has no effect: --data my/folder is not at a URL (the shard cache keeps shards fetched from "
        "object storage)"
    ]


@pytest.fixture(scope="session")
def lowest_omegaconf(tmp_path_factory) -> tuple[str, Path]:
    """The lowest omegaconf the train extra allows (2.3: what Hydra pins), installed from the package index into a
    folder of its own; skipped when no index answers."""
    from packaging.requirements import Requirement

    extra = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    (spec,) = (Requirement(r).specifier for r in extra if Requirement(r).name == "omegaconf")
    floor = next(s.version for s in spec if s.operator == ">=")
    version = floor if floor.count(".") == 2 else f"{floor}.0"
    target = tmp_path_factory.mktemp("omegaconf")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target", str(target)]
    try:
        r = subprocess.run([*pip, f"omegaconf=={version}"], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:  # an index that hangs: as much no answer as one that refuses
        pytest.skip(f"pip did not install omegaconf=={version} within 300 s")
    if r.returncode != 0:
        pytest.skip(f"pip cannot install omegaconf=={version} here: {r.stderr.strip().splitlines()[-1:]}")
    return version, target


@pytest.mark.slow
def test_the_config_works_with_the_lowest_omegaconf_the_extra_allows(lowest_omegaconf, tmp_path):
    """The probe: beside hydra-core (omegaconf < 2.4) every `gpupipe train` stopped at `Unexpected type annotation:
    Literal[fp32, bf16, fp16]`. The same config, file and errors with omegaconf 2.3 as with the one installed."""
    version, target = lowest_omegaconf
    f = tmp_path / "run.yaml"
    f.write_text("precision: bf16\nval: held out\nepochs: 3\n")
    args = ["--config", f, "--remode", "const", "--print-config"]

    def run(first: list[Path], *extra) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*first, REPO_ROOT]))}
        code = "import sys, omegaconf; from gpupipe.cli import main; print(omegaconf.__version__); sys.exit(main())"
        cmd = [sys.executable, "-c", code, "train", *map(str, [*args, *extra])]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)

    lowest, installed = run([target]), run([])
    assert lowest.returncode == 0, lowest.stderr
    assert lowest.stdout.splitlines()[0] == version
    assert lowest.stdout.splitlines()[1:] == installed.stdout.splitlines()[1:]
    assert "precision: bf16\n" in lowest.stdout and "val: held out\n" in lowest.stdout
    f.write_text("lr: 0.1\nprecision: fp8\n")
    wrong = run([target])
    assert (
        wrong.returncode == 2
        and wrong.stderr == f"error: {f}:2: precision must be one of fp32, bf16, fp16, got 'fp8'\n"
    )
    f.write_text("precision: bf16\n")
    flag = run([target], "--precision", "fp16")
    assert flag.returncode == 0 and "precision: fp16\n" in flag.stdout


def test_the_small_image_crop_flags_make_the_recipe(tmp_path, capsys):
    """--crop, --padding, --padding-mode and --hflip reach the train loader's recipe; bad values are one line."""
    import torch

    from gpupipe.cli import main
    from gpupipe.train.build import build_loaders

    from .common_utils import make_folder, train_config

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--crop {random-resized,pad,resize}" in text and "--padding-mode {zero,reflect}" in text
    data = make_folder(tmp_path / "d", 2, 4, sizes=((32, 32),))
    cfg = train_config(data, tmp_path / "run", crop="pad", padding=2, padding_mode="reflect", hflip=0.0)
    loader, _, _ = build_loaders(cfg, torch.device("cpu"))
    recipe = loader.recipe
    assert (recipe.crop, recipe.padding, recipe.padding_mode, recipe.flip_p) == ("pad", 2, "reflect", 0.0)
    for flags, said in ((["--padding", "-1"], "padding must be >= 0"), (["--hflip", "2"], "hflip must be")):
        assert main(["train", "--out", str(tmp_path / "run"), *flags, "--print-config"]) != 0
        assert said in capsys.readouterr().err


def test_cache_holds_the_training_and_validation_sets(tmp_path):
    """--cache device: both loaders hold their set (decoded once, batches cut from it); the default decodes."""
    import torch

    from gpupipe.train.build import build_loaders

    from .common_utils import make_folder, train_config

    data = make_folder(tmp_path / "d", 2, 4, sizes=((32, 32),))
    cfg = train_config(data, tmp_path / "run", val=str(data), cache="device", crop="resize", image_size=32)
    train, val, _ = build_loaders(cfg, torch.device("cpu"))
    assert val is not None and (getattr(train, "cache", None), getattr(val, "cache", None)) == ("device", "device")
    assert train.held_bytes == val.held_bytes == 8 * 3 * 32 * 32  # type: ignore[attr-defined]
    plain, _, _ = build_loaders(train_config(data, tmp_path / "run"), torch.device("cpu"))
    assert getattr(plain, "cache", None) is None


def test_print_config_shows_the_run_mode_a_config_file_sets(tmp_path, capsys):
    """``resume: true`` in a --config file takes effect (the run resumes), so --print-config shows it, after a comment
    saying that the run's config.yaml leaves it out; it was not shown at all. Without one, nothing more is shown."""
    from omegaconf import OmegaConf

    from gpupipe.cli import main

    f = tmp_path / "c.yaml"
    f.write_text("epochs: 3\nresume: true\n")
    assert main(["train", "--config", str(f), "--print-config"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("# how this command runs (left out of the run's config.yaml)\nresume: true\n"), out
    shown = OmegaConf.create(out)
    assert (shown.epochs, shown.resume) == (3, True)
    f.write_text("epochs: 3\n")
    assert main(["train", "--config", str(f), "--print-config"]) == 0
    assert "resume" not in capsys.readouterr().out
