"""The ``fastdata`` command.

``fastdata fit|validate|test|predict --config x.yaml``
    Lightning's ``LightningCLI`` over any ``LightningModule`` and any
    :class:`~lightning_fastdata.OptimizedDataModule` subclass, both chosen by
    ``class_path`` in the config.
``fastdata plan --config x.yaml``
    The resources, the store sizes, the chosen strategy and loader parameters with
    their reasons; it builds the cache if needed and trains nothing.
``fastdata bench --config x.yaml``
    Loader-only throughput (fetch, transfer to the device, augmentation) of every
    feasible strategy on the configured data module: a table, a recommendation that
    is the fastest measured strategy, and JSON with ``--json``.

``fastdata cache list|prune [--cache-dir DIR]``
    The on-disk caches (namespace, split, fingerprint, samples, size, created, last
    used, in use); ``prune`` removes the ones no process uses (``--older-than 30d``,
    ``--keep-latest``, ``--dry-run``) and says what it frees.

``plan`` and ``bench`` read the same config as ``fit`` (``model`` may be left out);
``trainer.accelerator`` and ``trainer.devices`` say which device and how many local
ranks the plan is for. A bad config fails with jsonargparse's message naming the key
and exit code 2, never a traceback from deep inside.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import re
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from jsonargparse.typing import NonNegativeInt, PositiveInt
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning_utilities.core import rank_zero as rank_zero_module

from lightning_fastdata import _lightning as door
from lightning_fastdata._util import atomic_write_text, fmt_bytes
from lightning_fastdata.autotune import shutdown_workers, time_loader
from lightning_fastdata.caches import CacheInfo, build_temporaries, list_caches, prune_caches
from lightning_fastdata.datamodule import OptimizedDataModule, default_cache_dir
from lightning_fastdata.loaders import ResumeError
from lightning_fastdata.plan import Plan, PlanError, Resources, decide, ram_text
from lightning_fastdata.structure import StoreError

#: Strategies ``bench`` tries, in the order of the table.
BENCH_STRATEGIES = ("device", "chunked", "workers")
_TOOLS = ("plan", "bench")
_LIGHTNING = ("fit", "validate", "test", "predict")
_USAGE = """usage: fastdata {fit,validate,test,predict,plan,bench} --config CONFIG.yaml [overrides]
       fastdata cache {list,prune} [--cache-dir DIR] [options]

Keep accelerators fed: a LightningCLI over any LightningModule and any
OptimizedDataModule subclass (both by class_path), plus two tools.

subcommands:
  fit, validate, test, predict   run Lightning (see `fastdata fit --help`)
  plan                           resources, store size, chosen strategy and loader
                                 parameters with their reasons; trains nothing
  bench                          loader-only samples/s of every feasible strategy on
                                 your data module; table, recommendation, --json out
  cache list                     the on-disk caches: namespace, split, fingerprint,
                                 samples, size, created, last used, in use
  cache prune                    remove caches no process uses (--older-than 30d,
                                 --keep-latest, --dry-run); prints what it frees
"""

# Errors raised by user classes' __init__ for a bad value (OptimizedDataModule's checks
# are ValueError/TypeError); they become a parser error naming the section, not a traceback.
_CONFIG_ERRORS = (ValueError, TypeError, PlanError, MisconfigurationException)


def _section(exc: BaseException) -> str:
    """Which config section's class raised ``exc``: the innermost Lightning object on the stack."""
    kinds = ((LightningDataModule, "data"), (LightningModule, "model"), (Trainer, "trainer"))
    found = ""
    seen: set[int] = set()
    chain: BaseException | None = exc
    while chain is not None and id(chain) not in seen:  # jsonargparse re-raises: follow the chain
        seen.add(id(chain))
        tb = chain.__traceback__
        while tb is not None:
            obj = tb.tb_frame.f_locals.get("self")
            for cls, name in kinds:
                if isinstance(obj, cls):
                    found = f"{name} ({type(obj).__module__}.{type(obj).__qualname__})"
            tb = tb.tb_next
        if found:
            break
        chain = chain.__cause__ or chain.__context__
    return found or "the configuration"


def _fail(parser: Any, exc: BaseException) -> None:
    parser.error(f"invalid value in {_section(exc)}: {exc}")


class FastDataCLI(LightningCLI):
    """``LightningCLI`` for any LightningModule and any OptimizedDataModule, by class_path.

    Args:
        args: Command-line arguments (default ``sys.argv[1:]``).
        run: Run the subcommand after instantiating.
        **kwargs: Passed to ``LightningCLI``.
    """

    def __init__(self, args: list[str] | None = None, run: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(None, OptimizedDataModule, subclass_mode_model=True, subclass_mode_data=True,
                         args=args, run=run, **kwargs)

    def instantiate_classes(self) -> None:
        """Instantiate as LightningCLI does; a bad value becomes a parser error naming the section."""
        try:
            super().instantiate_classes()
        except _CONFIG_ERRORS as e:
            _fail(door.cli_parser(self, self.subcommand), e)


class _ToolCLI(LightningCLI):
    """Parses the ``fit`` config for ``plan``/``bench``; instantiates the data module only."""

    def __init__(self, tool: str, args: list[str]) -> None:
        self.tool = tool
        self.datamodule: OptimizedDataModule
        super().__init__(None, OptimizedDataModule, subclass_mode_model=True, subclass_mode_data=True,
                         args=args, run=False, save_config_callback=None,
                         parser_kwargs={"description": _USAGE.splitlines()[0], "prog": f"fastdata {tool}"})

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The model is not needed to plan or to bench the loaders: accepted, not required.
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.add_lightning_class_args(LightningModule, "model", subclass_mode=True, required=False)
        parser.add_lightning_class_args(OptimizedDataModule, "data", subclass_mode=True)
        # A fit config (`fastdata fit --print_config`, Lightning's saved config.yaml) has
        # Trainer.fit's own arguments (ckpt_path, weights_only): accept them, typed as fit
        # types them, so the same file works here; nothing is fitted, so they do nothing.
        # A validate/test/predict config differs only by its method's own arguments
        # (verbose, return_predictions): accepted too, so any saved config of the same run works.
        methods = ("fit", "validate", "test", "predict")
        taken: set[str] = set()
        for method in methods:
            added = parser.add_method_arguments(self.trainer_class, method,
                                                skip=set(self.subcommands()[method]) | taken)
            if not added:
                continue
            taken |= set(added)
            owners = "/".join(m for m in methods  # `verbose` is validate's and test's
                              if set(added) <= set(inspect.signature(getattr(self.trainer_class, m)).parameters))
            door.label_arguments(parser, added, f"Trainer.{owners}'s own arguments, accepted so a {owners} config "
                                 f"works; ignored by {self.tool}", f"Ignored by {self.tool} ({owners}'s argument).")

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--json", type=str | None, default=None,
                            help="Write the report as JSON to this path ('-': stdout, the text then goes to stderr).")
        if self.tool == "bench":
            parser.add_argument("--batches", type=PositiveInt, default=30, help="Batches timed per repeat (a shorter "
                                "training split is drawn over several epochs).")
            parser.add_argument("--warmup", type=NonNegativeInt, default=3, help="Untimed batches before each repeat.")
            parser.add_argument("--repeats", type=PositiveInt, default=3, help="Repeats; the median is reported.")
            parser.add_argument("--progress", type=bool, default=True, help="Show a progress bar.")

    def instantiate_classes(self) -> None:
        """Instantiate the ``data`` section alone (no model, no Trainer: nothing trains)."""
        parser = LightningArgumentParser()
        parser.add_lightning_class_args(OptimizedDataModule, "data", subclass_mode=True)
        try:
            cfg = parser.parse_object({"data": self.config.data.as_dict()})
            instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
            self.datamodule = instantiate(cfg).data
        except _CONFIG_ERRORS as e:
            _fail(self.parser, e)


def target(trainer_cfg: Any, dm: OptimizedDataModule) -> tuple[torch.device, int]:
    """The device and the number of local ranks the Trainer config asks for.

    ``data.device`` wins over ``trainer.accelerator``; ``devices`` may be an int, "auto",
    -1, a list of ids or a string of them. With ids, the device is the first of them
    (``[1]`` trains on ``cuda:1``, as Lightning does), so the plan probes that GPU.

    Raises:
        PlanError: ``devices`` is none of those (a typo, 0, below -1), or ``data.device``
            is not a device name.
    """
    accel = str(getattr(trainer_cfg, "accelerator", "auto") or "auto").lower()
    cuda = accel in ("gpu", "cuda") or (accel == "auto" and torch.cuda.is_available())
    devices: Any = getattr(trainer_cfg, "devices", "auto")
    ids = _device_ids(devices)
    if ids is not None:
        n = len(ids)
    elif devices in ("auto", "-1", -1, None):
        n = torch.cuda.device_count() if cuda else 1
    else:
        n = _device_count(devices)
    if dm.device:
        try:
            device = torch.device(dm.device)
        except RuntimeError as e:  # torch's "Expected one of cpu, cuda, ... device type at start of ..."
            raise PlanError(f"data.init_args.device={dm.device!r} is not a device: use 'cpu', 'cuda' or "
                            f"'cuda:<index>', or null to follow trainer.accelerator ({e})") from None
    elif cuda:
        device = torch.device("cuda", ids[0]) if ids else torch.device("cuda")
    else:
        device = torch.device("cpu")
    return device, max(1, n)


_DEVICES_HELP = ("use an int > 0, -1 or 'auto' (every device), a list of device ids such as [0, 1], "
                 "or a string of them such as '0,1' or '1,'")


def _device_ids(devices: Any) -> list[int] | None:
    """The device ids a list or a comma string names (Lightning reads "1," as [1]); None for a count."""
    if isinstance(devices, (list, tuple)):
        ids = list(devices)
    elif isinstance(devices, str) and "," in devices:
        ids = [p.strip() for p in devices.split(",") if p.strip()]
    else:
        return None
    try:
        ids = [int(i) for i in ids]
    except (TypeError, ValueError):
        raise PlanError(f"trainer.devices={devices!r} names a device id that is not an integer; "
                        f"{_DEVICES_HELP}") from None
    if not ids or min(ids) < 0:
        raise PlanError(f"trainer.devices={devices!r} names no device or a negative id; {_DEVICES_HELP}")
    return ids


def _device_count(devices: Any) -> int:
    """A ``devices`` count (an int or a string of one) > 0; Lightning's fit refuses the rest."""
    try:
        n = int(devices)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise PlanError(f"trainer.devices={devices!r} is not a number of devices; {_DEVICES_HELP}")
    return n


def check_target(trainer_cfg: Any, dm: OptimizedDataModule, device: torch.device) -> None:
    """Refuse a CUDA target on a machine without CUDA, naming the setting that asks for it.

    Called before anything is built: planning for CUDA probes the device, which would
    otherwise fail with torch's RuntimeError after every cache was built. ``fit`` refuses
    the same config (Lightning: "No supported gpu backend found!").

    Raises:
        PlanError: ``trainer.accelerator`` or ``data.init_args.device`` asks for CUDA and
            ``torch.cuda.is_available()`` is False.
    """
    if torch.cuda.is_available():
        return
    accel = str(getattr(trainer_cfg, "accelerator", "auto") or "auto").lower()
    if accel in ("gpu", "cuda"):
        setting = f"trainer.accelerator={accel!r}"
    elif device.type == "cuda":
        setting = f"data.init_args.device={dm.device!r}"
    else:
        return
    raise PlanError(f"{setting} asks for CUDA, but CUDA is not available on this machine "
                    "(torch.cuda.is_available() is False); set it to 'cpu' to plan for the CPU")


def plan_for(dm: OptimizedDataModule, device: torch.device, local_world_size: int,
             strategy: str | None = None, resources: Resources | None = None) -> Plan:
    """The plan ``dm.setup("fit")`` would make on ``device`` as one of ``local_world_size`` ranks.

    Builds the caches if needed (``prepare_data``), opens the train and val stores and
    decides; nothing is placed on the device. ``strategy`` overrides the configured one.

    Raises:
        PlanError: a forced strategy cannot work here.
    """
    dm.prepare_data()
    dm.open_splits(("train", "val"))
    if not dm.stores and not dm.raw_sources:
        raise PlanError(f"{type(dm).__name__}.source('train') and source('val') returned None: nothing to plan")
    if resources is None:
        return dm.make_plan(device, local_world_size, strategy=strategy)
    config = dm.plan_config(device)
    if strategy is not None:
        config["strategy"] = strategy
    return decide(None if dm.raw_sources else sum(s.nbytes for s in dm.stores.values()), resources, config)


def describe_resources(r: Resources) -> str:
    """One paragraph on the machine the plan is for."""
    dev = "VRAM" if r.device_type == "cuda" else "RAM"
    return (f"cores: {r.physical_cores} physical, {r.logical_cores} logical (this process may use)\n"
            f"{ram_text(r)}: {fmt_bytes(r.ram_total)} total, {fmt_bytes(r.ram_available)} available\n"
            f"device: {r.device_type}, {dev} {fmt_bytes(r.device_total)} total, {fmt_bytes(r.device_free)} free\n"
            f"/dev/shm: {fmt_bytes(r.shm_free)} free\n"
            f"local ranks: {r.local_world_size}")


def _describe_field(info: Any) -> str:
    name = info.name or "sample"
    if info.encoding:
        return f"{name}: {info.encoding}, {fmt_bytes(info.row_nbytes)} per sample on average"
    if info.ragged:
        return (f"{name}: {np.dtype(info.dtype).name}, ragged {len(info.shape)}-D, "
                f"{fmt_bytes(info.row_nbytes)} per sample on average")
    return f"{name}: {np.dtype(info.dtype).name}{list(info.shape)}"


def describe_stores(dm: OptimizedDataModule) -> list[dict[str, Any]]:
    """Per split: samples, bytes, and where the cache lives."""
    out = []
    for split, store in dm.stores.items():
        out.append({"split": split, "samples": len(store), "nbytes": store.nbytes,
                    "fields": [_describe_field(i) for i in store.infos],
                    "path": str(store.path) if store.path else None})
    for split, src in dm.raw_sources.items():
        out.append({"split": split, "samples": len(src), "nbytes": None, "fields": [],
                    "path": "not stored: loaded per sample"})
    return out


def run_plan(dm: OptimizedDataModule, device: torch.device, local_world_size: int,
             json_path: str | None = None, out: Any = None) -> dict[str, Any]:
    """``fastdata plan``: print resources, stores and the plan with its reasons; return the report.

    The text goes to ``out`` (default stdout, or stderr when ``json_path`` is ``"-"``, so
    that stdout is the JSON alone).
    """
    out = out or _text_stream(json_path)
    plan = plan_for(dm, device, local_world_size)
    stores = describe_stores(dm)
    print("## resources\n" + describe_resources(plan.resources), file=out)
    print("\n## stores", file=out)
    for s in stores:
        size = fmt_bytes(s["nbytes"]) if s["nbytes"] is not None else "-"
        print(f"{s['split']}: {s['samples']} samples, {size} ({', '.join(s['fields'])}) at {s['path']}", file=out)
    print(f"total: {fmt_bytes(plan.store_nbytes)}", file=out)
    print("\n## plan", file=out)
    rows = [("strategy", plan.strategy), ("num_workers", plan.num_workers), ("pin_memory", plan.pin_memory),
            ("prefetch_factor", plan.prefetch_factor), ("persistent_workers", plan.persistent_workers)]
    if plan.strategy == "chunked":
        rows.append(("chunk_bytes", fmt_bytes(plan.chunk_bytes)))
    for key, value in rows:
        why = plan.reasons.get(key, "")
        print(f"{key} = {value}\n    {why}", file=out)
    for key, why in plan.reasons.items():
        if key not in dict(rows):
            print(f"{key}: {why}", file=out)
    report = {"device": str(device), "local_world_size": local_world_size, "stores": stores,
              "plan": plan.as_dict()}
    _write_json(report, json_path, out)
    return report


def run_bench(dm: OptimizedDataModule, device: torch.device, local_world_size: int, batches: int = 30,
              warmup: int = 3, repeats: int = 3, progress: bool = True, json_path: str | None = None,
              strategies: tuple[str, ...] = BENCH_STRATEGIES, out: Any = None) -> dict[str, Any]:
    """``fastdata bench``: time every feasible strategy's training loader; print a table; return the report.

    Each strategy runs with the loader parameters its plan gives for ``local_world_size``
    ranks; a timed batch is fetched, moved to ``device`` and augmented with
    ``train_augment``, as in training, without a model. A split shorter than ``warmup +
    batches`` batches is drawn epoch after epoch until ``batches`` are timed. Rates are
    the median of ``repeats``. The text goes to ``out`` (default stdout, or stderr when
    ``json_path`` is ``"-"``, so that stdout is the JSON alone).
    """
    out = out or _text_stream(json_path)
    # What strategy="auto" would pick, whatever the config forces: the advice compares with that.
    auto = plan_for(dm, device, local_world_size, strategy="auto")
    rows = [bench_strategy(dm, s, device, local_world_size, batches, warmup, repeats, progress) for s in strategies]
    measured = [r for r in rows if r.get("samples_per_s")]
    if not measured:
        raise PlanError("no strategy could be measured: " + "; ".join(f"{r['strategy']}: {r['reason']}" for r in rows))
    best = max(measured, key=lambda r: r["samples_per_s"])
    baseline = next((r for r in measured if r["strategy"] == "workers"), None)
    for r in measured:
        r["vs_workers"] = r["samples_per_s"] / baseline["samples_per_s"] if baseline else None
    auto_row = next((r for r in measured if r["strategy"] == auto.strategy), None)
    runner_up = max((r for r in measured if r is not best), key=lambda r: r["samples_per_s"], default=None)
    noise = ""
    if runner_up is not None and runner_up["samples_per_s"] >= 0.95 * best["samples_per_s"]:
        noise = (f"; '{runner_up['strategy']}' is within 5% ({runner_up['samples_per_s']:,.0f} samples/s): "
                 "either is fine, the gap is noise")
    if best["strategy"] == auto.strategy:
        advice = f"strategy: {best['strategy']} (measured fastest; it is what strategy='auto' picks here{noise})"
    else:
        ratio = (f", {best['samples_per_s'] / auto_row['samples_per_s']:.2f}x the auto choice "
                 f"'{auto.strategy}'" if auto_row else "")
        advice = f"strategy: {best['strategy']} (measured fastest{ratio}{noise}); " + (
            "the config sets it already" if dm.strategy == best["strategy"]
            else f"set data.init_args.strategy: {best['strategy']} in the config")
    report = {"device": str(device), "local_world_size": local_world_size, "batch_size": dm.batch_size,
              "batches": batches, "warmup": warmup, "repeats": repeats, "auto_strategy": auto.strategy,
              "recommendation": best["strategy"], "advice": advice, "results": rows,
              "resources": vars(auto.resources), "store_nbytes": auto.store_nbytes}
    print(format_table(rows, dm.batch_size, device), file=out)
    print(f"\nrecommendation: {advice}", file=out)
    _write_json(report, json_path, out)
    return report


def bench_strategy(dm: OptimizedDataModule, strategy: str, device: torch.device, local_world_size: int,
                   batches: int, warmup: int, repeats: int, progress: bool) -> dict[str, Any]:
    """Median loader-only samples/s of ``dm``'s training loader under ``strategy`` (one row of ``bench``).

    Returns:
        ``{"strategy", "feasible", "samples_per_s", "rates", "num_workers", ...}``, or
        ``feasible: False`` with the reason when the plan refuses the strategy.
    """
    saved = {k: getattr(dm, k) for k in ("strategy", "num_workers", "device")}
    quiet = getattr(rank_zero_module, "log", logging.getLogger("lightning.pytorch.utilities.rank_zero"))
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # setup's plan log, once per strategy, would bury the table
    try:
        return _bench_strategy(dm, strategy, device, local_world_size, batches, warmup, repeats, progress)
    finally:
        quiet.setLevel(level)
        for k, v in saved.items():
            setattr(dm, k, v)


def _bench_strategy(dm: OptimizedDataModule, strategy: str, device: torch.device, local_world_size: int,
                    batches: int, warmup: int, repeats: int, progress: bool) -> dict[str, Any]:
    try:
        plan = plan_for(dm, device, local_world_size, strategy=strategy)
    except PlanError as e:
        return {"strategy": strategy, "feasible": False, "reason": str(e)}
    dm.strategy, dm.device = strategy, str(device)
    if dm.num_workers in ("auto", "measure"):
        dm.num_workers = plan.num_workers  # as planned for local_world_size ranks, not for this process alone
    augment = dm.train_augment
    bar = _progress(strategy, repeats * (warmup + batches), progress)

    def consume(batch: Any) -> None:
        # Without an augmentation too: what on_after_batch_transfer does (a JPEG field decoded,
        # a ragged field split into its samples) is part of the loader's cost.
        dm.augment_batch(batch, augment)
        if bar is not None:
            bar.update(1)

    rates, timings, loader = [], [], None
    try:
        dm.setup("fit")
        loader = dm.train_dataloader()
        for _ in range(repeats):
            try:
                # cycle: a split of fewer than warmup + batches batches is drawn epoch after
                # epoch, so that the rate is over the batches asked for, not one partial batch.
                timing = time_loader(loader, device, batches=batches, warmup=warmup, consume=consume, cycle=True)
            except ValueError as e:  # time_loader's: no batch to time (a split smaller than one batch)
                return {"strategy": strategy, "feasible": False, "reason": _too_short(dm, loader, e)}
            rates.append(timing.samples_per_s)
            timings.append(timing)
    except (PlanError, RuntimeError) as e:
        return {"strategy": strategy, "feasible": False, "reason": f"{type(e).__name__}: {e}"}
    finally:
        if bar is not None:
            bar.close()
        shutdown_workers(loader)  # idle workers of one strategy must not linger into the next
        dm.teardown("fit")
    p = dm.plan or plan
    # The fewest of any repeat: what every rate was measured over at least.
    timed_batches = min(t.batches for t in timings)
    note = ""
    if timed_batches < batches:  # only a loader whose later pass is empty ends early
        note = f"only {timed_batches} of {batches} batches timed"
        warnings.warn(f"bench: strategy '{strategy}' timed only {timed_batches} of the {batches} batches asked "
                      "for (the training loader ran dry); its rate is from those alone", stacklevel=2)
    elif max(t.passes for t in timings) > 1:
        note = f"{max(t.passes for t in timings)} passes of a {_len_text(loader)} epoch"
    return {"strategy": strategy, "feasible": True, "samples_per_s": statistics.median(rates),
            "rates": rates, "num_workers": p.num_workers, "pin_memory": p.pin_memory,
            "prefetch_factor": p.prefetch_factor, "reason": plan.reasons.get("strategy", ""),
            "timed_batches": timed_batches, "timed_samples": min(t.samples for t in timings),
            "passes": max(t.passes for t in timings), "note": note}


def _len_text(loader: Any) -> str:
    """``"4-batch"``, or ``"short"`` for a loader without a length."""
    try:
        return f"{len(loader)}-batch"
    except TypeError:
        return "short"


def _too_short(dm: OptimizedDataModule, loader: Any, error: ValueError) -> str:
    """Why a loader could not be timed: how many batches it has, and from what."""
    try:
        n = len(loader)
    except TypeError:  # an iterable loader has no length: time_loader's message says what it drew
        return f"the training loader has too few batches to time: {error}"
    store = dm.stores.get("train")
    samples = f"{len(store)} samples, " if store is not None else ""
    return (f"the training loader has {n} batch{'' if n == 1 else 'es'} ({samples}batch_size {dm.batch_size}, "
            f"drop_last {dm.drop_last}): nothing to time")


def _progress(strategy: str, total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"bench {strategy}", unit="batch", leave=False, file=sys.stderr)


def format_table(rows: list[dict[str, Any]], batch_size: int, device: torch.device) -> str:
    """Markdown table of a bench report's rows."""
    lines = [f"loader-only throughput on {device}, batch {batch_size} (median of repeats)", "",
             "| strategy | samples/s | vs workers | num_workers | pin_memory | note |",
             "|---|---:|---:|---:|---|---|"]
    for r in rows:
        if r.get("samples_per_s"):
            vs = f"{r['vs_workers']:.2f}x" if r.get("vs_workers") else "-"
            note = f" {r['note']} " if r.get("note") else " "
            lines.append(f"| {r['strategy']} | {r['samples_per_s']:,.0f} | {vs} | {r['num_workers']} | "
                         f"{r['pin_memory']} |{note}|")
        else:
            lines.append(f"| {r['strategy']} | - | - | - | - | not feasible: {r['reason']} |")
    return "\n".join(lines)


def _text_stream(json_path: str | None) -> Any:
    """Where the human-readable report goes: stderr when the JSON takes stdout, so a pipe gets JSON only."""
    return sys.stderr if json_path == "-" else sys.stdout


def _write_json(report: dict[str, Any], path: str | None, out: Any) -> None:
    if not path:
        return
    text = json.dumps(report, indent=2, default=str)
    if path == "-":
        print(text, file=sys.stdout, flush=True)
        return
    dest = atomic_write_text(path, text + "\n")  # a reader never sees half a report
    print(f"\nwrote {dest}", file=out)


def check_json_path(path: str | None) -> None:
    """Refuse a ``--json`` path the report could not be written to, before anything is planned or timed.

    Raises:
        PlanError: the path is a directory, a parent is a file, or the nearest existing
            parent is not writable.
    """
    if not path or path == "-":
        return
    dest = Path(path)
    if dest.is_dir():
        raise PlanError(f"--json {path} is a directory; name a file, e.g. --json {dest / 'report.json'}")
    parent = dest.absolute().parent
    while not parent.exists() and parent != parent.parent:  # the directories atomic_write_text will make
        parent = parent.parent
    if not parent.is_dir():
        raise PlanError(f"--json {path}: {parent} is a file, not a directory; name a path in a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PlanError(f"--json {path}: the directory {parent} is not writable; name a path you may write")


def _in_cache_dir(error: OSError, dm: OptimizedDataModule) -> bool:
    """Whether ``error`` is about a path under the data module's cache_dir (a bad cache_dir, not a bug)."""
    root = Path(dm.cache_dir).absolute()
    for name in (error.filename, error.filename2):
        if name is not None:
            path = Path(os.fsdecode(name)).absolute()
            if path == root or root in path.parents:
                return True
    return False


def _run_tool(tool: str, args: list[str]) -> None:
    cli = _ToolCLI(tool, args)
    cfg, dm = cli.config, cli.datamodule
    try:
        device, ranks = target(cfg.trainer, dm)
        check_target(cfg.trainer, dm, device)
        check_json_path(cfg.json)
        if tool == "plan":
            run_plan(dm, device, ranks, json_path=cfg.json)
        else:
            run_bench(dm, device, ranks, batches=cfg.batches, warmup=cfg.warmup, repeats=cfg.repeats,
                      progress=cfg.progress, json_path=cfg.json)
    except (PlanError, StoreError) as e:
        # A StoreError names the cache or sample and the fix (a cache_dir that is a file, say).
        cli.parser.error(str(e))
    except OSError as e:
        if not _in_cache_dir(e, dm):
            raise
        cli.parser.error(f"data.init_args.cache_dir={str(dm.cache_dir)!r} cannot be used: {e}")


# --------------------------------------------------------------------------- fastdata cache

_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """``"30d"``, ``"12h"``, ``"90m"``, ``"45s"``, ``"2w"`` (a bare number is days) in seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"--older-than takes a number and a unit s, m, h, d or w (e.g. 30d), got {text!r}")
    return float(m[1]) * _AGE_UNITS[m[2] or "d"]


def _cache_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastdata cache", description="List or prune the on-disk caches.")
    sub = parser.add_subparsers(dest="action", required=True, metavar="{list,prune}")
    for name, text in (("list", "every cache: namespace, split, fingerprint, samples, size, created, last used"),
                       ("prune", "remove caches no process uses (an open or building cache is never removed)")):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--cache-dir", default=None,
                       help="the cache directory (default: $LIGHTNING_FASTDATA_CACHE or ~/.cache/lightning_fastdata)")
        if name == "prune":
            p.add_argument("--older-than", type=parse_age, default=None, metavar="AGE",
                           help="only caches last used longer ago than AGE (30d, 12h, 90m, 2w)")
            p.add_argument("--keep-latest", action="store_true",
                           help="keep the most recently used cache of every namespace and split")
            p.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    return parser


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else "-"


def _ago(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit} ago"
    return "just now"


def _rows(caches: list[CacheInfo], now: float) -> list[list[str]]:
    return [[c.namespace or "-", c.split, c.fingerprint, "-" if c.samples is None else f"{c.samples:,}",
             fmt_bytes(c.nbytes), c.created[:16].replace("T", " ") or "-",
             f"{_when(c.last_used)} ({_ago(now - c.last_used)})",
             "in use" if c.in_use else (c.problem or "")] for c in caches]


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
                     for r in [header, *rows])


def _missing_dir(cache_dir: str | os.PathLike) -> str:
    """Why ``cache_dir`` holds no cache to list (it is not a directory we read), or ``""``."""
    path = Path(cache_dir)
    if path.is_symlink():
        return "is a symbolic link, which fastdata does not follow"  # as list_caches refuses it
    if not path.exists():
        return "does not exist"
    if not path.is_dir():
        return "is not a directory"
    return ""


def run_cache(args: list[str], out: Any = None, now: float | None = None) -> list[Any]:
    """``fastdata cache list|prune``: print the caches, or prune them; return what was listed or done.

    A cache directory that is not there is said on stderr (a mistyped ``--cache-dir``
    would otherwise look like an empty one); it is not an error.

    Raises:
        SystemExit: 1 when ``prune`` failed to remove a cache it meant to remove.
    """
    out = out or sys.stdout
    ns = _cache_parser().parse_args(args)
    cache_dir = ns.cache_dir or default_cache_dir()
    now = time.time() if now is None else now
    header = ["namespace", "split", "fingerprint", "samples", "size", "created", "last used", "state"]
    missing = _missing_dir(cache_dir)
    if missing:
        print(f"fastdata cache: the cache directory {cache_dir} {missing}"
              f"{'; nothing to prune' if ns.action == 'prune' else ''}", file=sys.stderr)
    if ns.action == "list":
        caches = list_caches(cache_dir)
        total = sum(c.nbytes for c in caches)
        print(f"{len(caches)} cache(s) in {cache_dir}, {fmt_bytes(total)}", file=out)
        if caches:
            print(_table(header, _rows(caches, now)), file=out)
        temporaries = build_temporaries(cache_dir)
        if temporaries:
            print(f"and {len(temporaries)} temporary build directory(ies), "
                  f"{fmt_bytes(sum(b for _, b in temporaries))}: builds under way, or left by a killed build "
                  "(prune removes those)", file=out)
        return caches
    before = dict(build_temporaries(cache_dir))
    results = prune_caches(cache_dir, older_than_s=ns.older_than, keep_latest=ns.keep_latest, dry_run=ns.dry_run,
                           now=now)
    rows = []
    for r in results:
        (row,) = _rows([r.cache], now)
        verb = "removed" if r.removed else ("would remove" if r.reason == "would be removed" else r.reason)
        rows.append([verb, *row[:-1]])
    if rows:
        print(_table(["action", *header[:-1]], rows), file=out)
    done = [r for r in results if r.removed or (ns.dry_run and r.reason == "would be removed")]
    freed = sum(r.cache.nbytes for r in done)
    verb = "would free" if ns.dry_run else "freed"
    failed = [r for r in results if r.error]
    swept = [] if ns.dry_run else sorted(set(before) - {p for p, _ in build_temporaries(cache_dir)})
    freed += sum(before[p] for p in swept)
    print(f"{verb} {fmt_bytes(freed)}: {len(done)} cache(s) {'to remove' if ns.dry_run else 'removed'}, "
          f"{len(results) - len(done)} kept"
          f"{f', {len(swept)} temporary directory(ies) of killed builds removed' if swept else ''}"
          f"{f' ({len(failed)} could not be removed)' if failed else ''}, in {cache_dir}", file=out, flush=True)
    for r in failed:
        print(f"fastdata cache prune: error: could not remove {r.cache.path}: {r.error}", file=sys.stderr)
    if failed:
        raise SystemExit(1)  # a script must not take "kept" for "freed"
    return results


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``fastdata`` console script."""
    # We hand LightningCLI the arguments after our own subcommand dispatch on purpose.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
    argv = list(sys.argv[1:] if args is None else args)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        if not argv:
            raise SystemExit(2)
        return
    if argv[0] in ("cache", *_TOOLS):
        try:
            if argv[0] == "cache":
                run_cache(argv[1:])
            else:
                _run_tool(argv[0], argv[1:])
        except BrokenPipeError:
            # `fastdata cache list | head`: the reader left. Python's recipe: no traceback, and
            # stdout pointed at /dev/null so that the flush at exit does not fail again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise SystemExit(1) from None
    elif argv[0] in _LIGHTNING or argv[0].startswith("-"):
        try:
            FastDataCLI(args=argv)
        except (StoreError, PlanError, ResumeError) as e:
            # Raised inside Trainer.fit, past the parser (prepare_data's cache, setup's plan, a
            # checkpoint's loader position): the message names the culprit and the fix, which a
            # traceback would bury; plan and bench give the same one-line error.
            print(f"fastdata {argv[0]}: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
    else:
        print(_USAGE, file=sys.stderr)
        print(f"fastdata: error: unknown subcommand {argv[0]!r}; choose one of {_LIGHTNING + _TOOLS + ('cache',)}",
              file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":  # pragma: no cover
    main()
