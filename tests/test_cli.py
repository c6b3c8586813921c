"""The ``fastdata`` command: fit/validate/test through LightningCLI, ``plan``, ``bench``, bad configs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from lightning_fastdata.cli import FastDataCLI, main, target

TESTS = str(Path(__file__).parent)


def write_config(tmp_path: Path, data: dict | None = None, trainer: dict | None = None,
                 model: bool = True) -> str:
    """A fit config over tests/_cli_models.py, rooted in ``tmp_path``."""
    init = {"n": 96, "batch_size": 16, "cache_dir": str(tmp_path / "cache"), "device": "cpu",
            "train_augment": {"class_path": "lightning_fastdata.augment.Compose", "init_args": {"transforms": [
                {"class_path": "lightning_fastdata.augment.RandomCrop", "init_args": {"size": 8, "padding": 2}},
                {"class_path": "lightning_fastdata.augment.RandomHorizontalFlip"}]}}}
    init.update(data or {})
    cfg = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_epochs": 1, "logger": False,
                    "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
                    "default_root_dir": str(tmp_path / "run"), **(trainer or {})},
        "data": {"class_path": "_cli_models.CliImages", "init_args": init},
    }
    if model:
        cfg["model"] = {"class_path": "_cli_models.CliModel", "init_args": {"size": 8}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_fit_validate_test_through_lightning_cli(tmp_path):
    cfg = write_config(tmp_path)
    cli = FastDataCLI(args=["fit", "--config", cfg])
    assert type(cli.datamodule).__name__ == "CliImages" and cli.datamodule.batch_size == 16
    assert cli.model.steps == 6  # 96 samples / 16 per batch, one epoch
    assert cli.datamodule.plan.strategy == "device"
    main(["validate", "--config", cfg])
    # Persistent workers would outlive the call (the Trainer keeps the loader) and with them
    # the listener directory a worker makes in TMPDIR to pass batch file descriptors.
    main(["test", "--config", cfg, "--data.init_args.strategy", "workers",
          "--data.init_args.persistent_workers", "false"])


def test_plan_uses_the_cache_fit_built_from_the_same_config(tmp_path, capsys):
    # LightningCLI's instantiator puts "_class_path" and "_instantiator" in the data module's
    # hparams; plan builds it without them and used to build (and warn about) a second cache.
    cfg = write_config(tmp_path)
    FastDataCLI(args=["fit", "--config", cfg])
    caches = sorted(p.name for p in (tmp_path / "cache").glob("*/*-*") if not p.name.startswith("."))
    assert [c.split("-")[0] for c in caches] == ["test", "train", "val"]
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*building a new .* cache")
        main(["plan", "--config", cfg])
    assert sorted(p.name for p in (tmp_path / "cache").glob("*/*-*") if not p.name.startswith(".")) == caches
    capsys.readouterr()


def test_a_data_module_the_cli_built_loads_from_its_checkpoint_with_its_augmentation(tmp_path):
    # The CLI saves the augmentation as its {"class_path": ...} config, which Lightning's
    # instantiator rebuilds; the data module replaced it with its repr (text), and
    # load_from_checkpoint then asked the user to rebuild the pipeline by hand.
    cli = FastDataCLI(args=["fit", "--config", write_config(tmp_path)])
    path = tmp_path / "x.ckpt"
    cli.trainer.save_checkpoint(path)
    loaded = type(cli.datamodule).load_from_checkpoint(path)
    assert repr(loaded.train_augment) == repr(cli.datamodule.train_augment)
    assert repr(loaded.train_augment).startswith("Compose(")


def test_plan_prints_resources_stores_and_reasons(tmp_path, capsys):
    cfg = write_config(tmp_path)
    out = tmp_path / "plan.json"
    main(["plan", "--config", cfg, "--json", str(out)])
    text = capsys.readouterr().out
    for expected in ("## resources", "physical", "/dev/shm", "## stores", "train: 96 samples", "val: 48 samples",
                     "## plan", "strategy = device", "fits the budget", "num_workers = 0", "pin_memory = False"):
        assert expected in text, expected
    report = json.loads(out.read_text())
    assert report["plan"]["strategy"] == "device"
    assert report["plan"]["store_nbytes"] == (96 + 48) * (3 * 8 * 8 + 8)
    assert set(report["plan"]["reasons"]) >= {"strategy", "num_workers", "pin_memory", "prefetch_factor",
                                              "persistent_workers"}
    assert [s["split"] for s in report["stores"]] == ["train", "val"]
    assert not (tmp_path / "run").exists()  # nothing trained, no Trainer made


def test_plan_counts_the_trainers_local_ranks(tmp_path, capsys):
    cfg = write_config(tmp_path, data={"strategy": "workers"}, trainer={"devices": 4, "strategy": "ddp"},
                       model=False)
    main(["plan", "--config", cfg, "--json", "-"])
    report = json.loads(capsys.readouterr().out)  # stdout is the JSON alone: the report text goes to stderr
    assert report["local_world_size"] == 4
    assert "/ 4 local ranks" in report["plan"]["reasons"]["num_workers"]


def test_bench_times_every_strategy_and_recommends_the_fastest(tmp_path, capsys):
    cfg = write_config(tmp_path)
    out = tmp_path / "bench" / "bench.json"
    main(["bench", "--config", cfg, "--batches", "3", "--warmup", "1", "--repeats", "2", "--progress", "false",
          "--json", str(out)])
    text = capsys.readouterr().out
    assert "| strategy | samples/s |" in text and "recommendation: strategy:" in text
    report = json.loads(out.read_text())
    rows = {r["strategy"]: r for r in report["results"]}
    assert set(rows) == {"device", "chunked", "workers"}
    measured = [r for r in report["results"] if r.get("samples_per_s")]
    assert measured and all(len(r["rates"]) == 2 for r in measured)
    fastest = max(measured, key=lambda r: r["samples_per_s"])["strategy"]
    assert report["recommendation"] == fastest and f"strategy: {fastest}" in text
    assert rows["workers"]["num_workers"] == report["resources"]["physical_cores"] - 1 or \
        report["resources"]["physical_cores"] == 1
    assert report["auto_strategy"] == "device"


def test_bench_reports_an_infeasible_strategy_and_recommends_among_the_rest(tmp_path, capsys):
    cfg = write_config(tmp_path, data={"vram_fraction": 1e-9})
    main(["bench", "--config", cfg, "--batches", "2", "--warmup", "0", "--repeats", "1", "--progress", "false",
          "--json", str(tmp_path / "b.json")])
    text = capsys.readouterr().out
    report = json.loads((tmp_path / "b.json").read_text())
    device = next(r for r in report["results"] if r["strategy"] == "device")
    assert device["feasible"] is False and "strategy='device' needs" in device["reason"]
    assert "not feasible" in text
    assert report["recommendation"] != "device"


def test_json_to_stdout_is_parseable_and_the_report_goes_to_stderr(tmp_path, capsys):
    cfg = write_config(tmp_path)
    main(["plan", "--config", cfg, "--json", "-"])
    captured = capsys.readouterr()
    assert json.loads(captured.out)["plan"]["strategy"] == "device"
    assert "## plan" in captured.err and "## plan" not in captured.out
    main(["bench", "--config", cfg, "--batches", "2", "--warmup", "0", "--repeats", "1", "--progress", "false",
          "--json", "-"])
    captured = capsys.readouterr()
    assert {r["strategy"] for r in json.loads(captured.out)["results"]} == {"device", "chunked", "workers"}
    assert "recommendation:" in captured.err


def test_bench_compares_with_what_auto_picks_not_with_the_configured_strategy(tmp_path, capsys):
    cfg = write_config(tmp_path, data={"strategy": "chunked"})
    main(["bench", "--config", cfg, "--batches", "2", "--warmup", "0", "--repeats", "1", "--progress", "false",
          "--json", "-"])
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["auto_strategy"] == "device"  # what strategy='auto' picks on this CPU, not the config's chunked
    assert "the auto choice 'chunked'" not in report["advice"]
    if report["recommendation"] == "device":
        assert "it is what strategy='auto' picks here" in report["advice"]


def test_bench_marks_a_loader_too_short_to_time_as_not_feasible(tmp_path, capsys):
    """8 samples, batch 16 and drop_last: no training batch at all; a row says so, no traceback."""
    from _cli_models import CliImages

    from lightning_fastdata.cli import bench_strategy

    dm = CliImages(n=8, batch_size=16, drop_last=True, cache_dir=str(tmp_path / "cache"), device="cpu")
    row = bench_strategy(dm, "device", torch.device("cpu"), 1, batches=3, warmup=1, repeats=1, progress=False)
    assert row["feasible"] is False and "the training loader has 0 batches" in row["reason"]
    cfg = write_config(tmp_path, data={"n": 8, "drop_last": True})
    with pytest.raises(SystemExit) as e:
        main(["bench", "--config", cfg, "--batches", "3", "--warmup", "1", "--repeats", "1", "--progress", "false"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no strategy could be measured" in err and "the training loader has 0 batches" in err



def test_bench_times_the_batches_asked_for_over_several_passes_of_a_short_split(tmp_path, capsys):
    """40 samples, batch 16: 3 batches per epoch (the last of 8). Asked for 2 warm-up + 6 timed
    batches, the bench timed one partial batch and reported 6; it now draws 3 passes."""
    from _cli_models import CliImages

    from lightning_fastdata.cli import bench_strategy, format_table

    dm = CliImages(n=40, batch_size=16, cache_dir=str(tmp_path / "cache"), device="cpu")
    row = bench_strategy(dm, "device", torch.device("cpu"), 1, batches=6, warmup=2, repeats=2, progress=False)
    # Timed: batches 3 (8 samples), 1, 2, 3 (8), 1, 2 of passes 1-3.
    assert row["feasible"] and row["timed_batches"] == 6 and row["timed_samples"] == 16 * 4 + 8 * 2
    assert row["passes"] == 3 and row["note"] == "3 passes of a 3-batch epoch"
    assert "3 passes of a 3-batch epoch" in format_table([{**row, "vs_workers": 1.0}], 16, "cpu")

def test_plan_and_bench_accept_the_fit_subcommands_own_arguments(tmp_path, capsys):
    """A config from `fastdata fit --print_config` (or Lightning's saved config.yaml) has ckpt_path, weights_only."""
    import inspect

    from lightning.pytorch import Trainer

    # weights_only joined Trainer.fit in Lightning 2.6: a fit config has it only there.
    weights_only = "weights_only" in inspect.signature(Trainer.fit).parameters
    cfg = write_config(tmp_path)
    path = Path(cfg)
    path.write_text(path.read_text() + "ckpt_path: null\n" + ("weights_only: null\n" if weights_only else ""))
    main(["plan", "--config", cfg, "--ckpt_path", "last.ckpt"])
    assert "strategy = device" in capsys.readouterr().out
    main(["bench", "--config", cfg, "--batches", "1", "--warmup", "0", "--repeats", "1", "--progress", "false",
          *(["--weights_only", "true"] if weights_only else ["--ckpt_path", "x.ckpt"])])
    assert "recommendation:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "ignored by plan" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("subcommand", ["validate", "test", "predict"])
def test_plan_and_bench_read_a_config_saved_by_any_subcommand(tmp_path, capsys, subcommand):
    """`fastdata test --print_config` writes `verbose`, predict `return_predictions`: read like a fit config."""
    cfg = write_config(tmp_path)
    with pytest.raises(SystemExit):
        main([subcommand, "--config", cfg, "--print_config"])
    saved = tmp_path / f"{subcommand}.yaml"
    saved.write_text(capsys.readouterr().out)
    assert ("verbose:" if subcommand != "predict" else "return_predictions:") in saved.read_text()
    main(["plan", "--config", str(saved)])
    assert "strategy = device" in capsys.readouterr().out
    main(["bench", "--config", str(saved), "--batches", "1", "--warmup", "0", "--repeats", "1", "--progress", "false"])
    assert "recommendation:" in capsys.readouterr().out


@pytest.mark.parametrize("override, setting", [
    (["--trainer.accelerator", "gpu", "--data.init_args.device", "null"], "trainer.accelerator='gpu'"),
    (["--trainer.accelerator", "cuda"], "trainer.accelerator='cuda'"),
    (["--data.init_args.device", "cuda"], "data.init_args.device='cuda'"),
])
@pytest.mark.parametrize("tool", ["plan", "bench"])
def test_cuda_asked_for_without_cuda_is_a_parser_error_before_any_cache(tmp_path, capsys, monkeypatch, tool,
                                                                      override, setting):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = write_config(tmp_path)
    with pytest.raises(SystemExit) as e:
        main([tool, "--config", cfg, *override])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert setting in err and "CUDA" in err and "Traceback" not in err
    assert not (tmp_path / "cache").exists()  # failed before building anything


def test_fit_stops_on_a_plan_or_cuda_error_with_one_line_before_any_cache(tmp_path, capsys, monkeypatch):
    # fit gave a 14-frame traceback (exit 1) for a PlanError that plan and bench print on one
    # line, and with device=cuda on a machine without CUDA built every cache before torch's
    # "Found no NVIDIA driver" (found by review 87).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = write_config(tmp_path)
    for override, culprit in ((["--data.init_args.device", "cuda"], "device='cuda' asks for CUDA"),
                              (["--data.init_args.strategy", "device", "--data.init_args.store", "false"],
                               "store")):
        with pytest.raises(SystemExit) as e:
            main(["fit", "--config", cfg, *override])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("fastdata fit: error: ") and culprit in err, err
        assert "Traceback" not in err and not (tmp_path / "cache").exists()


def test_fit_resumed_with_another_batch_size_mid_epoch_says_what_to_do_on_one_line(tmp_path, capsys):
    cfg = write_config(tmp_path, trainer={"max_steps": 2, "enable_checkpointing": True})
    main(["fit", "--config", cfg])
    (ckpt,) = (tmp_path / "run").rglob("*.ckpt")  # step 2 of 6: inside the epoch
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["fit", "--config", cfg, "--ckpt_path", str(ckpt), "--trainer.max_steps", "4",
              "--data.init_args.batch_size", "8"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "checkpoint has batch_size=16, the loader has batch_size=8" in err, err
    assert "saved at an epoch's end" in err and "load only the checkpoint's weights" in err and "Traceback" not in err


def test_bench_shows_a_progress_bar(tmp_path, capsys):
    cfg = write_config(tmp_path)
    main(["bench", "--config", cfg, "--batches", "2", "--warmup", "0", "--repeats", "1"])
    assert "bench device" in capsys.readouterr().err


@pytest.mark.parametrize("tool", ["fit", "plan", "bench"])
@pytest.mark.parametrize("override, culprit", [
    (["--data.init_args.strategy", "fast"], "strategy"),
    (["--data.init_args.batch_size", "-1"], "batch_size must be an int > 0, got -1"),
    (["--data.init_args.num_workers", "-2"], "num_workers"),
    (["--data.class_path", "nowhere.Missing"], "nowhere"),
    (["--data.class_path", "_cli_models.CliModel"], "_cli_models.CliModel"),
])
def test_bad_config_is_a_clear_parser_error(tmp_path, capsys, tool, override, culprit):
    cfg = write_config(tmp_path)
    with pytest.raises(SystemExit) as e:
        main([tool, "--config", cfg, *override])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and culprit in err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_bad_value_names_the_config_section(tmp_path, capsys):
    cfg = write_config(tmp_path)
    with pytest.raises(SystemExit):
        main(["fit", "--config", cfg, "--data.init_args.vram_fraction", "3"])
    err = capsys.readouterr().err
    assert "data (_cli_models.CliImages)" in err and "vram_fraction must be in (0, 1], got 3" in err


def test_forced_strategy_that_cannot_work_is_an_error_for_plan(tmp_path, capsys):
    cfg = write_config(tmp_path, data={"strategy": "device", "vram_fraction": 1e-9})
    with pytest.raises(SystemExit) as e:
        main(["plan", "--config", cfg])
    assert e.value.code == 2
    assert "strategy='device' needs" in capsys.readouterr().err


def test_console_script_exits_with_the_message_and_no_traceback(tmp_path):
    cfg = write_config(tmp_path)
    script = Path(sys.executable).with_name("fastdata")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "lightning_fastdata.cli"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([*cmd, "plan", "--config", cfg, "--data.init_args.batch_size", "0"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "batch_size must be an int > 0, got 0" in proc.stderr and "Traceback" not in proc.stderr



def _demo_md_config() -> str:
    """The YAML block of docs/demo.md's "Training from a YAML config" section."""
    text = (Path(__file__).parents[1] / "docs" / "demo.md").read_text()
    section = text.split("## Training from a YAML config", 1)[1]
    return section.split("```yaml\n", 1)[1].split("\n```", 1)[0]


def test_the_yaml_config_in_docs_demo_md_trains_and_validates(tmp_path):
    """The snippet lacked eval_augment, so validation fed uint8 images to the float model and
    crashed ("expected scalar type Byte but found Float"). It is run as shown, on tiny data."""
    from lightning_fastdata import augment as A

    cfg = tmp_path / "demo.yaml"
    cfg.write_text(_demo_md_config())
    cli = FastDataCLI(args=["fit", "--config", str(cfg), "--data.init_args.root", str(tmp_path / "data"),
                            "--data.init_args.train_per_class", "2", "--data.init_args.val_per_class", "1",
                            "--data.init_args.cache_dir", str(tmp_path / "cache"), "--trainer.fast_dev_run", "1",
                            "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
                            "--trainer.default_root_dir", str(tmp_path / "run")])
    assert isinstance(cli.datamodule.eval_augment, A.Normalize)
    assert cli.trainer.fit_loop.epoch_loop.val_loop.batch_progress.total.completed == 1

def test_usage_lists_the_tools(capsys):
    main(["--help"])
    out = capsys.readouterr().out
    assert "plan" in out and "bench" in out and "fit" in out
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2 and "unknown subcommand 'frobnicate'" in capsys.readouterr().err


@pytest.mark.parametrize("trainer, expected", [
    ({"accelerator": "cpu", "devices": 1}, ("cpu", 1)),
    ({"accelerator": "cpu", "devices": 4}, ("cpu", 4)),
    ({"accelerator": "cpu", "devices": "3"}, ("cpu", 3)),
    ({"accelerator": "cpu", "devices": "auto"}, ("cpu", 1)),
    ({"accelerator": "gpu", "devices": [0, 2]}, ("cuda", 2)),
    ({"accelerator": "cuda", "devices": "0,1,3"}, ("cuda", 3)),
])
def test_target_reads_accelerator_and_devices(trainer, expected):
    dm = SimpleNamespace(device=None)
    device, ranks = target(SimpleNamespace(**trainer), dm)
    assert (device.type, ranks) == expected
    device, _ = target(SimpleNamespace(**trainer), SimpleNamespace(device="cpu"))
    assert device == torch.device("cpu")  # data.device wins


@pytest.mark.slow
def test_plan_and_bench_on_the_example_config(tmp_path, capsys):
    config = str(Path(__file__).resolve().parents[1] / "examples" / "config.yaml")
    small = ["--data.init_args.root", str(tmp_path / "demo"), "--data.init_args.cache_dir", str(tmp_path / "cache"),
             "--data.init_args.train_per_class", "20", "--data.init_args.val_per_class", "5",
             "--data.init_args.progress", "false", "--trainer.accelerator", "cpu"]
    main(["plan", "--config", config, *small])
    text = capsys.readouterr().out
    assert "train: 200 samples" in text and "strategy = device" in text
    main(["bench", "--config", config, *small, "--batches", "1", "--warmup", "0", "--repeats", "1",
          "--progress", "false", "--json", str(tmp_path / "bench.json")])
    text = capsys.readouterr().out
    report = json.loads((tmp_path / "bench.json").read_text())
    measured = [r for r in report["results"] if r.get("samples_per_s")]
    assert {r["strategy"] for r in measured} >= {"device", "workers"}
    assert report["recommendation"] == max(measured, key=lambda r: r["samples_per_s"])["strategy"]
    assert "| device |" in text and "recommendation:" in text


# --------------------------------------------------------------------------- fastdata cache


def _caches(tmp_path):
    """Two projects' caches: one open (in use), one unused and 40 days old, one unused and recent."""
    import warnings

    from _helpers import TinyDataModule

    class Other(TinyDataModule):
        pass

    cache = tmp_path / "cache"
    warnings.simplefilter("ignore")
    reading = TinyDataModule(n=40, cache_dir=str(cache), device="cpu", val=False)
    reading.setup("fit")  # holds its cache open
    old = TinyDataModule(n=40, shape=(3, 4, 4), cache_dir=str(cache), device="cpu", val=False)
    old.prepare_data()
    recent = Other(n=20, cache_dir=str(cache), device="cpu", val=False)
    recent.prepare_data()
    (old_path,) = [p for p in (cache / "_helpers.TinyDataModule").iterdir()
                   if p.is_dir() and p != reading.stores["train"].path]
    forty_days = time.time() - 40 * 86400
    os.utime(old_path / "last_used", (forty_days, forty_days))
    return cache, reading, old_path


def test_cache_list_into_a_closed_pipe_ends_without_a_traceback(tmp_path):
    """``fastdata cache list | head``: the reader leaves early; a BrokenPipeError traceback was printed."""
    cache, reading, _ = _caches(tmp_path)
    reading.stores["train"].close()
    command = [sys.executable, "-m", "lightning_fastdata.cli", "cache", "list", "--cache-dir", str(cache)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the interpreter has started: its first write meets a closed pipe
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and b"Traceback" not in err and b"BrokenPipeError" not in err


def test_cache_list_shows_every_cache_with_size_age_and_use(tmp_path, capsys):
    cache, reading, old_path = _caches(tmp_path)
    main(["cache", "list", "--cache-dir", str(cache)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"3 cache(s) in {cache}")
    assert lines[1].split() == ["namespace", "split", "fingerprint", "samples", "size", "created", "last", "used",
                                "state"]
    rows = {line.split()[2]: line for line in lines[2:]}
    fp = reading.stores["train"].fingerprint[:16]
    assert rows[fp].split()[:4] == ["_helpers.TinyDataModule", "train", fp, "40"] and rows[fp].endswith("in use")
    assert "(40.0d ago)" in rows[old_path.name[-16:]] and not rows[old_path.name[-16:]].endswith("in use")
    other = [r for r in rows.values() if "Other" in r]
    assert len(other) == 1 and other[0].split()[0].endswith("._caches._locals_.Other")


_KILLED_BUILD = """
import os, signal, sys, torch
from lightning_fastdata.store import build_store

def transform(sample):
    if int(sample) == 30:
        os.kill(os.getpid(), signal.SIGKILL)  # an OOM kill, a preempted node
    return torch.full((64,), int(sample) % 250, dtype=torch.uint8)

build_store(list(range(40)), transform, sys.argv[1], namespace="killed.Module", probes=2, num_workers=0,
            progress=False)
"""


def test_cache_prune_removes_what_a_killed_first_build_left_and_list_shows_it(tmp_path, capsys):
    # A namespace holding only the temporary of a killed first build was never swept: prune said
    # "freed 0 B" and list "0 cache(s)" while the (preallocated) store stayed on disk.
    cache = tmp_path / "cache"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _KILLED_BUILD, str(cache)], env=env, timeout=120)
    assert proc.returncode == -9
    (left,) = (cache / "killed.Module").glob(".tmp-*")
    main(["cache", "list", "--cache-dir", str(cache)])
    out = capsys.readouterr().out
    assert "0 cache(s)" in out and "and 1 temporary build directory(ies)" in out and "left by a killed build" in out
    main(["cache", "prune", "--cache-dir", str(cache)])
    out = capsys.readouterr().out
    assert "1 temporary directory(ies) of killed builds removed" in out and not left.exists()
    assert re.search(r"^freed (?!0 B)", out, re.M), out  # the bytes of the temporary


def test_cache_prune_never_touches_a_directory_of_the_users_in_the_cache_dir(tmp_path, capsys):
    # Every subdirectory of cache_dir was swept as a namespace, and anything named .tmp-* in it
    # older than a day was removed as a dead build's (found by review 94).
    mine = tmp_path / "cache" / "my_experiments" / ".tmp-run3"
    mine.mkdir(parents=True)
    (mine / "results.csv").write_text("1,2\n")
    old = time.time() - 3 * 86400
    os.utime(mine, (old, old))
    main(["cache", "list", "--cache-dir", str(tmp_path / "cache")])
    assert "temporary" not in capsys.readouterr().out
    main(["cache", "prune", "--cache-dir", str(tmp_path / "cache")])
    assert "temporary" not in capsys.readouterr().out and (mine / "results.csv").exists()
    from lightning_fastdata.store import sweep_temporaries

    (tmp_path / "cache" / ".tmp-notes").mkdir()
    os.utime(tmp_path / "cache" / ".tmp-notes", (old, old))
    assert sweep_temporaries(tmp_path / "cache") == [] and (tmp_path / "cache" / ".tmp-notes").exists()
    # A namespace holding only the trash of a removal that failed midway is still one (review 95).
    trash = tmp_path / "cache" / "proj.Data" / ".tmp-trash~elsewhere~1~train-0123456789abcdef"
    trash.mkdir(parents=True)
    (trash / "field_0.npy").write_bytes(b"x" * 100)
    os.utime(trash, (old, old))
    main(["cache", "list", "--cache-dir", str(tmp_path / "cache")])
    assert "and 1 temporary build directory(ies)" in capsys.readouterr().out
    main(["cache", "prune", "--cache-dir", str(tmp_path / "cache")])
    assert "1 temporary directory(ies) of killed builds removed" in capsys.readouterr().out and not trash.exists()
    shutil.rmtree(tmp_path / "cache")  # the suite's own check of leftover temporaries would take them for ours


def test_cache_prune_removes_only_unused_caches_and_says_what_it_frees(tmp_path, capsys):
    cache, reading, old_path = _caches(tmp_path)
    before = {p for p in cache.rglob("*") if p.is_dir()}
    main(["cache", "prune", "--cache-dir", str(cache), "--dry-run"])
    out = capsys.readouterr().out
    assert out.count("would remove") == 2 and "kept: in use" in out and "would free" in out
    assert {p for p in cache.rglob("*") if p.is_dir()} == before  # a dry run removes nothing
    main(["cache", "prune", "--cache-dir", str(cache), "--older-than", "30d"])
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if old_path.name[-16:] in x]  # listed in fingerprint order
    assert line.startswith("removed") and not old_path.exists()
    assert out.strip().splitlines()[-1].startswith("freed ") and "1 cache(s) removed, 2 kept" in out
    main(["cache", "prune", "--cache-dir", str(cache), "--keep-latest"])
    assert "0 cache(s) removed, 2 kept" in capsys.readouterr().out  # each is the latest of its namespace
    main(["cache", "prune", "--cache-dir", str(cache)])
    out = capsys.readouterr().out
    assert "1 cache(s) removed, 1 kept" in out and "kept: in use (a process has it open)" in out
    assert reading.stores["train"].path.exists()
    reading.stores["train"].close()
    main(["cache", "prune", "--cache-dir", str(cache)])
    assert "1 cache(s) removed, 0 kept" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["cache", "prune", "--cache-dir", str(cache), "--older-than", "3x"])
    assert e.value.code == 2
    assert "--older-than takes a number and a unit s, m, h, d or w (e.g. 30d), got '3x'" in capsys.readouterr().err


def test_cache_prune_reports_a_cache_it_could_not_remove(tmp_path, capsys, monkeypatch):
    """A failed removal is listed as kept with the error, frees nothing and exits 1."""
    import warnings

    from _helpers import TinyDataModule

    from lightning_fastdata import store
    from lightning_fastdata.caches import prune_caches

    cache = tmp_path / "cache"
    warnings.simplefilter("ignore")
    TinyDataModule(n=40, cache_dir=str(cache), device="cpu", val=False).prepare_data()
    (path,) = [p for p in (cache / "_helpers.TinyDataModule").iterdir() if p.is_dir()]
    rename = os.rename

    def refuse(src, dst, *args, **kwargs):
        if Path(src) == path:  # as an immutable directory (chattr +i) would; the tests run as root
            raise PermissionError(1, "Operation not permitted", str(src), None, str(dst))
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(store.os, "rename", refuse)
    (result,) = prune_caches(cache)
    assert not result.removed and result.error and "Operation not permitted" in result.reason
    with pytest.raises(SystemExit) as e:
        main(["cache", "prune", "--cache-dir", str(cache)])
    assert e.value.code == 1
    captured = capsys.readouterr()
    assert "kept: could not remove it (Operation not permitted)" in captured.out
    assert "freed 0 B: 0 cache(s) removed, 1 kept" in captured.out and "removed  " not in captured.out
    assert f"could not remove {path}" in captured.err
    assert path.exists()
    monkeypatch.undo()
    main(["cache", "prune", "--cache-dir", str(cache)])
    assert "1 cache(s) removed, 0 kept" in capsys.readouterr().out and not path.exists()


@pytest.mark.parametrize("make", ["missing", "file"])
def test_cache_list_and_prune_say_when_the_cache_dir_is_not_there(tmp_path, capsys, make):
    where = tmp_path / "nowhere"
    if make == "file":
        where.write_text("")
    main(["cache", "list", "--cache-dir", str(where)])  # exit 0: nothing cached is not an error
    err = capsys.readouterr().err
    assert str(where) in err and ("does not exist" if make == "missing" else "is not a directory") in err
    main(["cache", "prune", "--cache-dir", str(where)])
    captured = capsys.readouterr()
    assert str(where) in captured.err and "nothing to prune" in captured.err
    assert not where.exists() or where.is_file()  # prune creates nothing


def test_bench_augments_each_batch_once(tmp_path, monkeypatch):
    """Batches the loader augmented ahead are not augmented a second time by the timing loop."""
    from _helpers import TinyDataModule

    from lightning_fastdata import augment as A
    from lightning_fastdata.cli import bench_strategy

    calls = []

    class Counting(A.Normalize):
        def __call__(self, x, keys=None):
            calls.append(1)
            return super().__call__(x, keys)

    dm = TinyDataModule(n=64, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", val=False,
                        train_augment=Counting([0.5] * 3, [0.25] * 3))
    row = bench_strategy(dm, "device", __import__("torch").device("cpu"), 1, batches=4, warmup=1, repeats=1,
                         progress=False)
    assert row["feasible"] and 5 <= len(calls) <= 5 + 2  # warm-up + timed batches (+ the thread's look-ahead)


def test_bench_decodes_a_jpeg_field_without_an_augmentation(tmp_path, monkeypatch):
    """The timed loop does what on_after_batch_transfer does: without train_augment a JPEG field is
    still decoded (the bench left it undecoded, so its rates left out the decode)."""
    import torch

    from lightning_fastdata import OptimizedDataModule
    from lightning_fastdata import datamodule as datamodule_module
    from lightning_fastdata.cli import bench_strategy

    decoded = []
    real = datamodule_module.decode_jpegs

    def counting(data, *args, **kwargs):
        decoded.append(len(data))
        return real(data, *args, **kwargs)

    monkeypatch.setattr(datamodule_module, "decode_jpegs", counting)

    class Photos(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 32

        def __getitem__(self, i: int):
            return torch.full((3, 16 + i % 5, 16), i, dtype=torch.uint8), i

    class PhotoModule(OptimizedDataModule):
        def source(self, split: str):
            return Photos() if split == "train" else None

    dm = PhotoModule(batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", encode={"0": "jpeg"}, progress=False)
    row = bench_strategy(dm, "device", torch.device("cpu"), 1, batches=2, warmup=1, repeats=1, progress=False)
    assert row["feasible"] and sum(decoded) >= 3 * 8  # warm-up + timed batches, every sample decoded


@pytest.mark.parametrize("devices, expected", [([1], ("cuda:1", 1)), ("1,", ("cuda:1", 1)),
                                               ("1,2", ("cuda:1", 2)), ([2, 0], ("cuda:2", 2)), (2, ("cuda", 2))])
def test_target_is_the_first_gpu_id_that_trainer_devices_names(devices, expected):
    device, ranks = target(SimpleNamespace(accelerator="gpu", devices=devices), SimpleNamespace(device=None))
    assert (str(device), ranks) == expected


def test_plan_and_bench_probe_the_gpu_that_trainer_devices_names(tmp_path, capsys, monkeypatch):
    # devices: [1] probed 'cuda', the current device (GPU 0): with GPU 0 nearly full, plan said
    # "chunked" while fit, on cuda:1 with 15 GB free, chose "device"; bench timed on cuda:0.
    import lightning_fastdata.cli as cli

    free = {0: (1 << 30) + 20_000, 1: 15 * 10**9}
    probed = []

    def mem_get_info(device=None):
        index = torch.device(device).index if device is not None else None
        probed.append(str(device))
        return free[index or 0], 16 * 10**9

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    cfg = write_config(tmp_path, data={"device": None}, trainer={"accelerator": "gpu", "devices": [1]}, model=False)
    main(["plan", "--config", cfg])
    out = capsys.readouterr().out
    assert probed and set(probed) == {"cuda:1"}
    assert "15.0 GB free" in out and "strategy = device" in out
    timed = []
    monkeypatch.setattr(cli, "run_bench", lambda dm, device, ranks, **kw: timed.append((str(device), ranks)))
    main(["bench", "--config", cfg])
    assert timed == [("cuda:1", 1)]


@pytest.mark.parametrize("devices", ["abc", "-2", "0", "1,x"])
def test_a_bad_trainer_devices_is_a_parser_error_naming_it(tmp_path, capsys, devices):
    # "abc" was a raw int() traceback; -2 and 0 were planned as one local rank, which fit refuses.
    cfg = write_config(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["plan", "--config", cfg, "--trainer.devices", devices])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"trainer.devices={devices!r}" in err and "Traceback" not in err
    assert not (tmp_path / "cache").exists()  # refused before any cache was built


@pytest.mark.parametrize("tool", ["plan", "bench", "fit"])
def test_a_cache_dir_that_is_a_file_is_a_one_line_error(tmp_path, capsys, tool):
    # The StoreError was raised by prepare_data, outside the parser's checks: exit 1 with a traceback.
    afile = tmp_path / "afile"
    afile.write_text("")
    cfg = write_config(tmp_path, data={"cache_dir": str(afile)})
    with pytest.raises(SystemExit) as e:
        main([tool, "--config", cfg])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"cache_dir {afile} exists and is not a directory" in err and "Traceback" not in err


@pytest.mark.parametrize("where", ["adir", "afile/report.json"])
def test_a_json_path_that_cannot_be_written_is_refused_before_planning(tmp_path, capsys, where):
    # A directory: the report printed, then IsADirectoryError; under a file: FileExistsError.
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("")
    cfg = write_config(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["plan", "--config", cfg, "--json", str(tmp_path / where)])
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert f"--json {tmp_path / where}" in captured.err and "Traceback" not in captured.err
    assert "## plan" not in captured.out and not (tmp_path / "cache").exists()


def test_plan_says_the_ram_is_the_containers_memory_limit(tmp_path, capsys, monkeypatch):
    from lightning_fastdata import _util

    (tmp_path / "proc").write_text("0::/job\n")
    (tmp_path / "cg" / "job").mkdir(parents=True)
    (tmp_path / "cg" / "job" / "memory.max").write_text(f"{1 << 30}\n")
    (tmp_path / "cg" / "job" / "memory.current").write_text(f"{100 << 20}\n")
    monkeypatch.setattr(_util, "PROC_CGROUP", str(tmp_path / "proc"))
    monkeypatch.setattr(_util, "CGROUP_ROOT", str(tmp_path / "cg"))
    main(["plan", "--config", write_config(tmp_path)])
    out = capsys.readouterr().out
    assert "RAM (the container's memory limit): 1.1 GB total" in out
    assert "60% of 1.1 GB RAM (the container's memory limit)" in out
