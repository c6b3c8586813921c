"""The one door to private Lightning/torch names: each accessor works here and fails loudly when a name
moves; no private Lightning/torch name is used anywhere else in the package."""

from __future__ import annotations

import ast
import functools
import multiprocessing.context
import re
from pathlib import Path

import lightning
import pytest
import torch
from _helpers import TinyModel
from _helpers import trainer as make_trainer
from _timing import Spend, SpendingModel, Vectors, loader
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from torch.utils.data import DataLoader

import lightning_fastdata
from lightning_fastdata import _lightning as door

PKG = Path(lightning_fastdata.__file__).parent
VERSION = re.escape(f"lightning {lightning.__version__}")
CHECKED = re.escape(door.CHECKED["lightning"])


# ---------------------------------------------------------------------- (a) each accessor


def test_timing_sites_resolve_on_the_installed_lightning(tmp_path):
    trainer = make_trainer(tmp_path)
    sites = door.timing_sites(trainer)
    epoch_loop = trainer.fit_loop.epoch_loop
    assert [s.obj for s in sites.before_fetch] == [epoch_loop, epoch_loop.val_loop, trainer.validate_loop]
    assert all(s.original.__self__ is s.obj for s in (*sites.before_fetch, *sites.after_fetch))
    assert sites.auto_run.obj is epoch_loop.automatic_optimization
    assert sites.manual_run.obj is epoch_loop.manual_optimization


def test_timing_sites_name_a_moved_fetch_hook_and_the_version(tmp_path, monkeypatch):
    monkeypatch.delattr(_TrainingEpochLoop, "_on_before_fetch")
    with pytest.raises(door.DoorClosed, match=rf"_TrainingEpochLoop\._on_before_fetch \(fetch start hook\) is "
                                              rf"missing in {VERSION}; .* checked it on lightning {CHECKED}"):
        door.timing_sites(make_trainer(tmp_path))


def test_timing_sites_refuse_a_step_called_another_way(tmp_path, monkeypatch):
    def run(self, optimizer, kwargs):  # Lightning 2.0's signature
        raise AssertionError("never called")

    monkeypatch.setattr(_AutomaticOptimization, "run", run)
    with pytest.raises(door.DoorClosed, match=r"_AutomaticOptimization\.run\(optimizer, batch_idx, kwargs\) "
                                              r"\(automatic optimisation step, called as run\(optimizer, kwargs\)"):
        door.timing_sites(make_trainer(tmp_path))


def test_batches_that_stepped_counts_and_names_its_attribute(tmp_path):
    trainer = make_trainer(tmp_path)
    trainer.fit(SpendingModel(Spend(0.0)), loader(16, 4, Spend(0.0)))
    assert door.batches_that_stepped(trainer) == 4 == trainer.global_step
    del trainer.fit_loop.epoch_loop._batches_that_stepped
    with pytest.raises(door.DoorClosed, match=rf"_TrainingEpochLoop\._batches_that_stepped .* {VERSION}"):
        door.batches_that_stepped(trainer)


def test_training_step_args_follow_the_step_signature(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path)
    trainer.fit(SpendingModel(Spend(0.0)), loader(8, 4, Spend(0.0)))
    batch = ("x", "y")
    assert door.training_step_args(trainer, batch, 3) == (batch, 3)
    monkeypatch.delattr(_TrainingEpochLoop, "_build_kwargs")
    with pytest.raises(door.DoorClosed, match=r"_build_kwargs \(training_step arguments\)"):
        door.training_step_args(trainer, batch, 3)


def test_fetched_batch_is_none_between_runs_and_names_a_moved_fetcher(tmp_path):
    trainer = make_trainer(tmp_path)
    assert door.fetched_batch(trainer.fit_loop) is None

    class Loop:  # a loop whose fetcher lost the batch attribute
        _data_fetcher = object()

    with pytest.raises(door.DoorClosed, match=r"object\._batch \(the batch a dataloader_iter step took\)"):
        door.fetched_batch(Loop())
    with pytest.raises(door.DoorClosed, match=r"_data_fetcher"):
        door.fetched_batch(object())


def test_prefetch_iter_is_the_prefetching_fetchers_own_and_names_a_move(monkeypatch):
    site = door.prefetch_iter()
    assert site.obj is _PrefetchDataFetcher and site.original is vars(_PrefetchDataFetcher)["__iter__"]
    fetcher = _PrefetchDataFetcher()
    start, stop = door.fetch_hooks(fetcher)
    door.bind_fetch_hooks(fetcher, stop, start)
    assert door.fetch_hooks(fetcher) == (stop, start)
    monkeypatch.delattr(_PrefetchDataFetcher, "__iter__")
    with pytest.raises(door.DoorClosed, match=rf"_PrefetchDataFetcher\.__iter__ \(the first batch's prefetch\) "
                                              rf"is missing in {VERSION}"):
        door.prefetch_iter()


def test_batch_index_record_is_what_the_prediction_loop_reads(monkeypatch):
    from lightning.pytorch.loops.prediction_loop import _PredictionLoop
    from lightning.pytorch.overrides import distributed

    class Loader:
        order = None

        def __len__(self) -> int:
            return 2

    record = door.batch_index_record(Loader())
    record.seen_batch_indices.append([3, 4])

    class Holder:
        batch_sampler = record

    loop = _PredictionLoop.__new__(_PredictionLoop)
    assert _PredictionLoop._get_batch_indices(loop, Holder()) == [[3, 4]]
    monkeypatch.delattr(distributed, "_IndexBatchSamplerWrapper")
    with pytest.raises(door.DoorClosed, match=r"_IndexBatchSamplerWrapper \(the prediction loop's record of batch "
                                              r"indices\) is missing"):
        door.batch_index_record(Loader())


def test_patches_set_a_class_attribute_back_only_while_it_holds_their_wrapper():
    class Fetcher:
        def __iter__(self):
            return iter([1])

    site, patches = door.Site(Fetcher, "__iter__", vars(Fetcher)["__iter__"]), door.Patches()
    patches.wrap(site, lambda self: iter([2]))
    assert list(Fetcher()) == [2]
    patches.restore()
    assert list(Fetcher()) == [1] and vars(Fetcher)["__iter__"] is site.original
    patches.wrap(site, lambda self: iter([2]))

    def later(self):  # another run wrapped the class after this one
        return iter([3])

    Fetcher.__iter__ = later
    patches.restore()
    assert vars(Fetcher)["__iter__"] is later


def test_cli_parser_is_the_subcommand_parser(tmp_path, monkeypatch):
    cli = LightningCLI(TinyModel, run=False, args=["--trainer.logger", "false",
                                                   f"--trainer.default_root_dir={tmp_path}"])
    assert door.cli_parser(cli, None) is cli.parser
    monkeypatch.delattr(LightningCLI, "_parser")
    with pytest.raises(door.DoorClosed, match=rf"LightningCLI\._parser .* {VERSION}"):
        door.cli_parser(cli, None)


def test_shutdown_dataloader_workers_stops_persistent_workers():
    dl = DataLoader(Vectors(8), batch_size=4, num_workers=1, persistent_workers=True)
    assert door.shutdown_dataloader_workers(dl) is False  # nothing started yet
    list(dl)
    workers = list(dl._iterator._workers)
    assert door.shutdown_dataloader_workers(dl) is True
    assert dl._iterator is None and not any(w.is_alive() for w in workers)
    with pytest.raises(door.DoorClosed, match=rf"object\._iterator .* missing in torch {re.escape(torch.__version__)}"):
        door.shutdown_dataloader_workers(object())  # type: ignore[arg-type]


def test_reclass_worker_dataset_swaps_the_class_or_raises_type_error():
    base = Vectors(4)

    class Sub(Vectors):
        pass

    door.reclass_worker_dataset(base, Sub)
    assert type(base) is Sub and len(base) == 4
    with pytest.raises(TypeError):
        door.reclass_worker_dataset(3, Sub)


def test_pickling_for_process_start_reads_multiprocessing(monkeypatch):
    assert door.pickling_for_process_start() is False
    multiprocessing.context.set_spawning_popen(object())
    try:
        assert door.pickling_for_process_start() is True
    finally:
        multiprocessing.context.set_spawning_popen(None)
    monkeypatch.delattr(multiprocessing.context, "get_spawning_popen")
    with pytest.raises(door.DoorClosed, match=r"get_spawning_popen .* missing in python"):
        door.pickling_for_process_start()


def test_hidden_hooks_are_not_dispatched_and_come_back(tmp_path):
    calls = []

    class Counting(lightning.pytorch.Callback):
        def on_train_batch_start(self, *args):
            calls.append("start")

    cb = Counting()
    door.hide_hooks(cb, ("on_train_batch_start", "on_train_batch_end"), lightning.pytorch.Callback)
    assert cb.on_train_batch_start is not None  # overridden: kept
    assert cb.on_train_batch_end is None
    make_trainer(tmp_path, callbacks=[cb]).fit(SpendingModel(Spend(0.0)), loader(8, 4, Spend(0.0)))
    assert calls == ["start", "start"]
    door.show_hooks(cb, ("on_train_batch_end",))
    assert callable(cb.on_train_batch_end)


# ---------------------------------------------------------------------- (b) nowhere else

#: The package's own marker attributes, set on objects it creates (wrappers, arrays).
MARKERS = ("_lfd_", "_fastdata_")
#: Private names the issue and the pre-stop checklist list: refused outside the door even in text.
LISTED = ("_on_before_fetch", "_on_after_fetch", "_batches_that_stepped", "_build_kwargs", "_data_fetcher",
          "_AutomaticOptimization", "_ManualOptimization", "_call_callback_hooks", "_shutdown_workers",
          "_iterator", "_parser", "get_spawning_popen")
#: Uses another helper is removing (loaders.py switches to door.shutdown_dataloader_workers).
PENDING: set[tuple[str, str]] = set()
_STRING_ACCESS = {"getattr", "setattr", "hasattr", "delattr", "__setattr__", "__delattr__", "__getattribute__"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@functools.cache
def _foreign_private_names() -> frozenset[str]:
    """Every private name lightning and torch define (methods, classes, attributes set on self, class attributes)."""
    pattern = re.compile(rb"(?:\bdef |\bclass |\bself\.|^[ \t]+)(_[A-Za-z]\w*)\s*[(:=]?", re.M)
    names: set[str] = set()
    for root in (Path(lightning.__file__).parent, Path(torch.__file__).parent):
        for f in root.rglob("*.py"):
            names.update(m.decode() for m in pattern.findall(f.read_bytes()))
    return frozenset(names)


def _own_private_names(trees: dict[str, ast.Module]) -> set[str]:
    """Private names the package defines: functions, classes, module/class attributes, self/cls attributes, slots."""
    own: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Name):
                        own.add(t.id)
                    elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in ("self",
                                                                                                           "cls"):
                        own.add(t.attr)
                if (isinstance(target, ast.Name) and target.id == "__slots__"
                        and isinstance(node.value, (ast.Tuple, ast.List))):
                    own.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
    return {n for n in own if _is_private(n)}


def private_uses(sources: dict[str, str]) -> list[str]:
    """Private Lightning/torch names used in ``sources`` (file name -> text), as ``file:line: what``.

    The rule: an attribute whose name starts with ``_`` (dunders aside), read or written
    (``x._y``, or ``getattr``/``setattr``/``hasattr``/``delattr``/``object.__setattr__`` with the
    name as a string), must be one the package defines itself (or a ``_lfd_``/``_fastdata_``
    marker); one that lightning or torch also define is the package's own only on ``self``/``cls``.
    Also refused: importing a private name or module of lightning or torch, assigning an
    object's ``__class__``, and the listed names anywhere in the text, comments included.
    """
    trees = {name: ast.parse(text) for name, text in sources.items()}
    own, foreign = _own_private_names(trees), _foreign_private_names()
    found = []

    def check(file: str, line: int, receiver: ast.AST, name: str) -> None:
        if not _is_private(name) or name.startswith(MARKERS) or (file, name) in PENDING:
            return
        on_self = isinstance(receiver, ast.Name) and receiver.id in ("self", "cls")
        if name not in own:
            found.append(f"{file}:{line}: {ast.unparse(receiver)}.{name} (not the package's own)")
        elif name in foreign and not on_self:
            found.append(f"{file}:{line}: {ast.unparse(receiver)}.{name} (lightning/torch define it too)")

    for file, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                check(file, node.lineno, node.value, node.attr)
            elif isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                fn = node.func
                fname = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
                if fname in _STRING_ACCESS and isinstance(node.args[1].value, str):
                    check(file, node.lineno, node.args[0], node.args[1].value)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
                paths = [module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
                for path in paths:
                    parts = path.split(".")
                    if parts[0] not in ("lightning", "torch", "pytorch_lightning", "lightning_fabric"):
                        continue
                    bad = [p for p in parts[1:] if _is_private(p)] + [n for n in names if _is_private(n)]
                    if bad:
                        found.append(f"{file}:{node.lineno}: import of {path} {bad}")
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Attribute) and t.attr == "__class__":
                        found.append(f"{file}:{node.lineno}: {ast.unparse(t)} = ... (a class swap)")
        for name in LISTED:
            for m in re.finditer(rf"(?<!\w){name}(?!\w)", sources[file]):
                if (file, name) not in PENDING:
                    line = sources[file].count("\n", 0, m.start()) + 1
                    found.append(f"{file}:{line}: {name} in the text")
    return found


def _package_sources() -> dict[str, str]:
    return {f.name: f.read_text() for f in sorted(PKG.glob("*.py")) if f.name != "_lightning.py"}


def test_no_private_lightning_or_torch_name_outside_the_door():
    uses = private_uses(_package_sources())
    assert uses == [], "use lightning_fastdata/_lightning.py (add an accessor there):\n" + "\n".join(uses)


@pytest.mark.parametrize("code, expected", [
    ("def f(trainer):\n    return trainer.fit_loop.epoch_loop._batches_that_stepped\n", "_batches_that_stepped"),
    ("def f(loop):\n    return getattr(loop, '_data_fetcher', None)\n", "loop._data_fetcher"),
    ("def f(dl):\n    object.__setattr__(dl, '_index_sampler', None)\n", "dl._index_sampler"),
    ("from torch.utils.data._utils.collate import default_collate\n", "import of torch.utils.data._utils"),
    ("from lightning.pytorch.loops.fetchers import _DataFetcher\n", "_DataFetcher"),
    ("import torch\ntorch.cuda._sleep(1)\n", "torch.cuda._sleep"),
    ("class C(LightningCLI):\n    def f(self):\n        return self._parser(None)\n", "self._parser"),
    ("def f(ds, cls):\n    ds.__class__ = cls\n", "a class swap"),
    ("class Mine:\n    def _apply(self):\n        pass\n\ndef f(module):\n    module._apply()\n",
     "module._apply (lightning/torch define it too)"),
    ("x = 1  # calls multiprocessing's get_spawning_popen\n", "get_spawning_popen in the text"),
])
def test_the_check_catches_each_kind_of_use(code, expected):
    uses = private_uses({"mod.py": code})
    assert any(expected in u for u in uses), uses


def test_the_check_lets_the_packages_own_names_pass():
    code = ("class A:\n    __slots__ = ('_slot',)\n    def __init__(self):\n        self._raw = {}\n"
            "        self._apply = 1\n    def _open_splits(self):\n        return self._raw, self._slot, self._apply\n"
            "\ndef f(a):\n    a.fn._lfd_marker = True\n    return a._raw, a._open_splits()\n")
    assert private_uses({"mod.py": code}) == []
