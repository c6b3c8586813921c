"""The one door to private Lightning, torch and multiprocessing names.

Every private name the package relies on is reached through a function here and nowhere
else (``tests/test_lightning_door.py`` walks the package and fails on any other use). Each
says which versions it was read on; a name that has moved raises :class:`DoorClosed`,
which names the attribute, the installed version and the versions checked. A caller that
can do without (the profiler falls back to public callback hooks) catches it.

Versions checked. Lightning: the names were read in the sources of 2.0.9, 2.1.0, 2.1.4,
2.2.0, 2.2.5, 2.3.3, 2.4.0, 2.5.0, 2.5.6, 2.6.0 and 2.6.6; all are present from 2.1.0 on
(2.0.9 lacks the dataloader_iter fetcher's batch and passes no ``batch_idx`` to the
automatic optimisation loop). The package's floor is 2.4.0 for another reason (older
Lightning cannot load its own checkpoints under torch >= 2.6, see ``pyproject.toml``);
the Lightning-facing tests run on 2.4.0 (``make test-oldest``) and 2.6.6. torch: read and
run on 2.14.1. Python's multiprocessing: read and run on 3.11.
"""

from __future__ import annotations

import importlib
import inspect
import multiprocessing.context
import platform
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: Versions each package's names were checked on (see the module docstring).
CHECKED = {"lightning": "2.1.0 to 2.6.6", "torch": "2.14.1", "python": "3.11"}


class DoorClosed(RuntimeError):
    """A private name this package relies on is not where it was: names it, the version, and the versions checked."""

    def __init__(self, owner: str, name: str, what: str, package: str = "lightning") -> None:
        # Imported here, not at the top: shared memory and seeding code runs in DataLoader workers.
        installed = platform.python_version() if package == "python" else importlib.import_module(package).__version__
        super().__init__(f"{owner}.{name} ({what}) is missing in {package} {installed}; lightning_fastdata "
                         f"relies on it and checked it on {package} {CHECKED[package]}. Install a {package} "
                         "version in that range, or report this version to lightning_fastdata.")
        self.owner, self.name, self.package = owner, name, package


def _attr(obj: Any, name: str, what: str, package: str = "lightning") -> Any:
    """``obj.name``, or :class:`DoorClosed` naming it."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise DoorClosed(type(obj).__name__, name, what, package) from None


# ---------------------------------------------------------------------- instance wrappers


@dataclass(frozen=True)
class Site:
    """One attribute of a Lightning object that is wrapped for a run: the object, its name, its value now."""

    obj: Any
    name: str
    original: Any


class Patches:
    """Wrappers set on instances of Lightning's objects for one run, restored in reverse order."""

    def __init__(self) -> None:
        self._sites: list[Site] = []
        self._wrappers: dict[int, Callable[..., Any]] = {}  # a class's wrapper, by id of its site

    def wrap(self, site: Site, wrapper: Callable[..., Any]) -> None:
        """Set ``wrapper`` on ``site.obj`` (an instance, or a class) for this run (marked, so a
        second profiler can see it)."""
        # Never read obj.__dict__: on CPython 3.11+ that materialises the instance dict and slows
        # every later attribute read on these hot loop objects (measured: ~2% of a step).
        self._sites.append(site)
        wrapper._fastdata_wrapper = True  # type: ignore[attr-defined]
        if isinstance(site.obj, type):
            self._wrappers[id(site)] = wrapper
            setattr(site.obj, site.name, wrapper)
        else:
            object.__setattr__(site.obj, site.name, wrapper)

    def restore(self) -> None:
        """Undo every wrapper: a method of the object's class shows through again."""
        for site in reversed(self._sites):
            if isinstance(site.obj, type):
                # A class is shared by every Trainer in the process: set back only while it
                # still holds this run's wrapper.
                if getattr(site.obj, site.name) is self._wrappers.pop(id(site), None):
                    setattr(site.obj, site.name, site.original)
            else:
                restore(site)
        self._sites.clear()

    def __bool__(self) -> bool:
        return bool(self._sites)


def site(obj: Any, name: str) -> Site:
    """A public attribute of a Lightning object as a :class:`Site` (``strategy.batch_to_device``...)."""
    return Site(obj, name, getattr(obj, name))


def restore(s: Site) -> None:
    """Undo a wrapper set on ``s.obj``: a bound method of its class is removed, anything else set back."""
    if getattr(s.original, "__self__", None) is s.obj:  # a bound method: it came from the class
        object.__delattr__(s.obj, s.name)
    else:
        object.__setattr__(s.obj, s.name, s.original)


def is_wrapped(fn: Any) -> bool:
    """Whether ``fn`` is a wrapper set through :class:`Patches`."""
    return bool(getattr(fn, "_fastdata_wrapper", False))


# ---------------------------------------------------------------------- the training loop


@dataclass(frozen=True)
class TimingSites:
    """Where the profiler's timers go in one Trainer, every name resolved before anything is wrapped.

    ``before_fetch``/``after_fetch``: per loop that fetches batches (the training epoch loop,
    its validation loop, ``trainer.validate``'s loop), the hooks its data fetcher calls around
    ``next(iterator)`` (bound to the fetcher at each epoch's start, after callbacks' ``setup``;
    the loop calls them through instance attribute lookup). ``auto_run``: the automatic
    optimisation loop's ``run(optimizer, batch_idx, kwargs)``; ``manual_run``: the manual one's
    ``run(kwargs)``; both called positionally, the step's kwargs holding the batch.
    ``val_run``: the validation loop inside fit's ``run()``, which returns after every
    callback's ``on_validation_end`` (a checkpoint saved there included).
    """

    before_fetch: tuple[Site, ...]
    after_fetch: tuple[Site, ...]
    auto_run: Site
    manual_run: Site
    val_run: Site


# Checked on Lightning 2.1.0 to 2.6.6 (source read); 2.0.9's automatic run took (optimizer, kwargs).
_AUTO_RUN = ("optimizer", "batch_idx", "kwargs")
_MANUAL_RUN = ("kwargs",)


def timing_sites(trainer: Any) -> TimingSites:
    """The loop internals the step timer wraps; :class:`DoorClosed` when any has moved (nothing is touched).

    Checked on Lightning 2.1.0 to 2.6.6: ``_TrainingEpochLoop._on_before_fetch`` /
    ``_on_after_fetch`` and ``_EvaluationLoop``'s, ``_AutomaticOptimization.run`` and
    ``_ManualOptimization.run`` with the parameters above, ``_EvaluationLoop.run()``.
    """
    fit_loop = _attr(trainer, "fit_loop", "the fit loop")
    epoch_loop = _attr(fit_loop, "epoch_loop", "the training epoch loop")
    val_loop = _attr(epoch_loop, "val_loop", "validation inside fit")
    loops = (epoch_loop, val_loop, _attr(trainer, "validate_loop", "trainer.validate's loop"))
    before = tuple(Site(lp, "_on_before_fetch", _attr(lp, "_on_before_fetch", "fetch start hook")) for lp in loops)
    after = tuple(Site(lp, "_on_after_fetch", _attr(lp, "_on_after_fetch", "fetch end hook")) for lp in loops)
    runs = []
    for attr, params, what in (("automatic_optimization", _AUTO_RUN, "automatic optimisation step"),
                               ("manual_optimization", _MANUAL_RUN, "manual optimisation step")):
        loop = _attr(epoch_loop, attr, what)
        run = _attr(loop, "run", what)
        try:
            names = tuple(inspect.signature(run).parameters)
        except (TypeError, ValueError):
            names = ()
        if names != params:
            raise DoorClosed(type(loop).__name__, f"run({', '.join(params)})",
                             f"{what}, called as run({', '.join(names)}) here")
        runs.append(Site(loop, "run", run))
    return TimingSites(before, after, runs[0], runs[1], Site(val_loop, "run", _attr(val_loop, "run", "validation run")))


def batches_that_stepped(trainer: Any, epoch_end: bool = False) -> int:
    """The step Lightning's loggers use (``log_every_n_steps`` counts it); Lightning 2.1.0 to 2.6.6.

    ``epoch_end``: in ``on_train_epoch_end``, the step of the epoch's last batch, where Lightning
    logs its own epoch metrics (it steps back by one for them).
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    step = int(_attr(epoch_loop, "_batches_that_stepped", "the logging step"))
    return max(0, step - 1) if epoch_end else step


def accumulating(trainer: Any) -> bool:
    """Whether the training batch running now only accumulates gradients (no optimizer step).

    Lightning's own step logging skips those batches (``update_train_step_metrics``, automatic
    optimisation only) and counts its logging step once per stepping batch. Lightning 2.1.0 to
    2.6.6: ``_TrainingEpochLoop._should_accumulate()``, valid from the batch's start to its end.
    """
    if not trainer.lightning_module.automatic_optimization:
        return False
    return bool(_attr(trainer.fit_loop.epoch_loop, "_should_accumulate", "gradient accumulation state")())


def restarted_mid_epoch(trainer: Any) -> bool:
    """Whether ``fit`` resumed inside a training epoch, where Lightning skips ``on_train_epoch_start``.

    Lightning 2.6.0 to 2.6.6: ``_FitLoop.restarted_mid_epoch`` (public on the private loop), set
    in the loop's ``reset`` before ``on_train_start``. Lightning 2.4.0 to 2.5.x calls
    ``on_train_epoch_start`` on every restart and has no such property: False there.
    """
    return bool(getattr(trainer.fit_loop, "restarted_mid_epoch", False))


def training_steps_in_flight(trainer: Any) -> int | None:
    """Training batches fetched whose step has not run to its end yet (``batch_progress.current``:
    ready less processed; 1 while a step runs or after it raised, else 0); None where the loop
    has no such tracker. Lightning 2.1.0 to 2.6.6 (the difference is the same whether or not a
    restart re-counted the batch a checkpoint was saved in)."""
    try:
        current = trainer.fit_loop.epoch_loop.batch_progress.current
        return max(0, int(current.ready) - int(current.processed))
    except AttributeError:
        return None


def fetched_batch(loop: Any) -> Any:
    """The batch a ``dataloader_iter`` step's fetcher took last, or None when the loop has no fetcher.

    Lightning 2.1.0 to 2.6.6: ``loop._data_fetcher`` (None between runs), a
    ``_DataLoaderIterDataFetcher`` whose ``_batch`` is the batch handed to the step.
    """
    fetcher = loop_fetcher(loop)
    if fetcher is None:
        return None
    return _attr(fetcher, "_batch", "the batch a dataloader_iter step took")


def prefetch_iter() -> Site:
    """``_PrefetchDataFetcher.__iter__``: where a loader without a length has its first batch fetched.

    Lightning 2.1.0 to 2.6.6: ``iter(fetcher)`` fetches ``prefetch_batches`` (1) batches
    through the fetcher's ``_start_profiler``/``_stop_profiler``, and the loops bind their fetch
    hooks to those only afterwards (``_FitLoop.setup_data`` for the first epoch and a reloaded
    loader, ``_EvaluationLoop.reset`` for every run): their hooks never see that batch.
    """
    from lightning.pytorch.loops import fetchers

    cls = _attr(fetchers, "_PrefetchDataFetcher", "the prefetching data fetcher")
    if "__iter__" not in vars(cls):
        raise DoorClosed(cls.__name__, "__iter__", "the first batch's prefetch")
    return Site(cls, "__iter__", vars(cls)["__iter__"])


def fetch_hooks(fetcher: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """The hooks a data fetcher calls around ``next(iterator)``; Lightning 2.1.0 to 2.6.6."""
    return (_attr(fetcher, "_start_profiler", "fetch start hook"),
            _attr(fetcher, "_stop_profiler", "fetch end hook"))


def bind_fetch_hooks(fetcher: Any, start: Callable[[], None], stop: Callable[[], None]) -> None:
    """Set the hooks a data fetcher calls around ``next(iterator)`` (see :func:`fetch_hooks`)."""
    fetcher._start_profiler, fetcher._stop_profiler = start, stop


def loop_fetcher(loop: Any) -> Any:
    """A loop's data fetcher (None between runs); Lightning 2.1.0 to 2.6.6: ``loop._data_fetcher``."""
    return _attr(loop, "_data_fetcher", "the loop's data fetcher")


class _IndexBatches:
    """The batches of sample indices a :func:`batch_index_record` describes (never iterated by Lightning)."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Any:
        order = self._loader.order
        return (b.tolist() for b in order.batches())


def batch_index_record(loader: Any) -> Any:
    """What Lightning's prediction loop reads a batch's sample indices from, for prediction writers.

    Lightning 2.1.0 to 2.6.6: ``_PredictionLoop._get_batch_indices`` takes
    ``loader.batch_sampler.seen_batch_indices[batch_idx]`` when the batch sampler is a
    ``lightning.pytorch.overrides.distributed._IndexBatchSamplerWrapper`` (else it warns and
    writers get ``[]``). The loader fills ``seen_batch_indices`` as it yields batches.
    """
    from lightning.pytorch.overrides import distributed

    cls = _attr(distributed, "_IndexBatchSamplerWrapper", "the prediction loop's record of batch indices")
    record = cls(_IndexBatches(loader))
    record.seen_batch_indices = []  # its __init__ sets it, then replaces its __dict__ with the sampler's
    return record


def training_step_args(trainer: Any, batch: Any, batch_idx: int) -> tuple[Any, ...]:
    """Positional arguments for ``strategy.training_step`` as the loop builds them (``batch_idx`` only
    when ``training_step`` takes it); Lightning 2.1.0 to 2.6.6 (``_build_kwargs(kwargs, batch, batch_idx)``)."""
    build = _attr(trainer.fit_loop.epoch_loop, "_build_kwargs", "training_step arguments")
    return tuple(build({}, batch, batch_idx).values())


def hide_hooks(callback: Any, names: tuple[str, ...], base: type) -> None:
    """Keep Lightning from dispatching hooks that ``base`` defines and a subclass does not override.

    Lightning's dispatch skips a callback hook attribute that is not callable (``if
    callable(fn)`` in ``trainer/call.py``, 2.1.0 to 2.6.6), so each is set to None on the
    instance: each dispatch costs ~1.4 us per step even for an empty hook.
    """
    for name in names:
        if getattr(type(callback), name, None) is getattr(base, name):
            object.__setattr__(callback, name, None)


def show_hooks(callback: Any, names: tuple[str, ...]) -> None:
    """Undo :func:`hide_hooks` for ``names``: the class's methods are dispatched again."""
    for name in names:
        if name in vars(callback):
            object.__delattr__(callback, name)


# ---------------------------------------------------------------------- LightningCLI


def cli_parser(cli: Any, subcommand: str | None) -> Any:
    """The parser of ``subcommand`` (the top-level one for None); ``LightningCLI._parser``, 2.1.0 to 2.6.6."""
    return _attr(cli, "_parser", "a subcommand's parser")(subcommand)


def label_arguments(parser: Any, dests: Any, title: str, help_text: str) -> None:
    """Retitle the argument group holding ``dests`` and set their help (argparse keeps both private)."""
    for group in getattr(parser, "_action_groups", []):
        if any(a.dest in dests for a in getattr(group, "_group_actions", [])):
            group.title, group.description = title, None
    for action in getattr(parser, "_actions", []):
        if action.dest in dests:
            action.help = help_text


# ---------------------------------------------------------------------- torch


def shutdown_dataloader_workers(loader: torch.utils.data.DataLoader) -> bool:
    """Stop a DataLoader's worker processes now (persistent workers otherwise live until collected).

    torch 2.14.1: ``DataLoader._iterator`` (None until the first persistent iteration) and
    ``_MultiProcessingDataLoaderIter._shutdown_workers``. Returns whether workers were stopped.
    """
    it = _attr(loader, "_iterator", "the persistent workers' iterator", "torch")
    if it is None:
        return False
    stop = getattr(it, "_shutdown_workers", None)  # a single-process iterator has no workers to stop
    if stop is not None:
        stop()
    loader._iterator = None
    return stop is not None


def reclass_worker_dataset(dataset: Any, cls: type) -> None:
    """Give the worker's dataset object class ``cls`` (a subclass of its own), in a worker process.

    Relies on torch's worker loop indexing the very object ``get_worker_info().dataset``
    returns (``_worker_loop`` passes one ``dataset`` to ``WorkerInfo`` and to
    ``_DatasetKind.create_fetcher``; torch 2.14.1). Raises TypeError where Python refuses.
    """
    dataset.__class__ = cls


def reclass_sampler(sampler: Any, cls: type) -> None:
    """Give a DataLoader's (batch) sampler class ``cls`` (a subclass of its own, in the main process).

    Relies on torch's loader iterator calling ``iter()`` on the very object
    ``DataLoader._index_sampler`` returns, at each iteration and each persistent-worker
    reset (``_BaseDataLoaderIter.__init__`` and ``_reset``; torch 2.14.1). Raises TypeError
    where Python refuses (``__slots__``, built-in types).
    """
    sampler.__class__ = cls


def namedtuple_fields(cls: type) -> tuple[str, ...] | None:
    """The field names of a namedtuple class, else None.

    Python's namedtuple API (``_fields``: public per the ``collections`` docs, despite its
    underscore); here so that every underscore name the package reads is in this file.
    """
    fields = getattr(cls, "_fields", None)
    return fields if isinstance(fields, tuple) and issubclass(cls, tuple) else None


def tensor_version(t: torch.Tensor) -> int:
    """The in-place write counter of ``t`` (bumped by every in-place op on it or a view of it).

    ``Tensor._version``: undocumented; read and run on torch 2.14.1. Used to tell that a
    cached statistic of a tensor (label block counts) no longer describes it.
    """
    return int(_attr(t, "_version", "the in-place write counter of a tensor", "torch"))


# ---------------------------------------------------------------------- multiprocessing


def pickling_for_process_start() -> bool:
    """Whether this thread is pickling the arguments of a process being started (spawn/forkserver).

    ``multiprocessing.context.get_spawning_popen``: undocumented; read and run on Python 3.11.
    """
    get = _attr(multiprocessing.context, "get_spawning_popen", "pickling for a process start", "python")
    return get() is not None


def quiet_shared_hook_warnings() -> None:
    """Silence Lightning's "overridden in both LightningModule and LightningDataModule" warning.

    ``OptimizedDataModule`` owns the batch hooks and calls the LightningModule's own ones
    itself, so the warning (``_DataHookSelector.get_instance``, Lightning 2.4 - 2.6) would
    claim a hook is skipped when it is not. Only the three batch hooks are silenced.
    """
    warnings.filterwarnings(
        "ignore",
        message=r"You have overridden `(on_before_batch_transfer|transfer_batch_to_device|on_after_batch_transfer)`"
                r" in both `LightningModule` and `LightningDataModule`",
    )


# ---------------------------------------------------------------------- hyperparameters


def given_hyperparameters() -> dict | None:
    """The init arguments LightningCLI's instantiator is building a module with (its config:
    an augmentation as a ``{"class_path": ..., "init_args": ...}`` dict), or None outside it.

    ``lightning.pytorch.core.mixins.hparams_mixin._given_hyperparameters``: a ContextVar that
    ``save_hyperparameters`` reads (Lightning 2.3 on; read on 2.4.0, 2.5.6 and 2.6.6).
    """
    mixin = importlib.import_module("lightning.pytorch.core.mixins.hparams_mixin")
    given = _attr(mixin, "_given_hyperparameters", "the CLI's hyperparameters").get()
    return dict(given) if given is not None else None
