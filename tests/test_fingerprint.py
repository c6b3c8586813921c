"""Fingerprint: what changes a cache (code, init arguments, files, random sources) and what does not."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest
import torch
from _helpers import CountingDataset
from torch.utils.data import ConcatDataset, Dataset, Subset, TensorDataset

from lightning_fastdata import OptimizedDataModule
from lightning_fastdata import augment as A
from lightning_fastdata.fingerprint import Canon, discover_files
from lightning_fastdata.store import fingerprint


class Indexed(Dataset):
    """``n`` samples ``(image filled with i % 200, i)``; counts reads."""

    def __init__(self, n: int = 64, size: int = 4) -> None:
        self.n, self.size, self.calls = n, size, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.calls += 1
        return torch.full((3, self.size, self.size), i % 200, dtype=torch.uint8), i


class Counting(OptimizedDataModule):
    """Counts static_transform calls; ``size`` is an init argument that shapes the data."""

    def __init__(self, size: int = 4, n: int = 64, **kwargs) -> None:
        kwargs.setdefault("progress", False)
        kwargs.setdefault("device", "cpu")
        super().__init__(**kwargs)
        self.size, self.n = size, n
        self.calls = 0

    def source(self, split):
        return Indexed(self.n, self.size) if split == "train" else None

    def static_transform(self, sample):
        self.calls += 1
        return sample


def _messages(record) -> list[str]:
    return [str(w.message) for w in record if "lightning_fastdata" in str(w.message)]


# --------------------------------------------------------------------------- code


_EDITED = '''
import torch
from torch.utils.data import Dataset

from lightning_fastdata import OptimizedDataModule


class Samples(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((3, 4, 4), i, dtype=torch.uint8), i


class Edited(OptimizedDataModule):
    def source(self, split):
        return Samples() if split == "train" else None

    def static_transform(self, sample):
        image, index = sample
        {BODY}
        return image, index
'''


def _write_module(path, name: str, text: str):
    (path / f"{name}.py").write_text(text)
    importlib.invalidate_caches()
    if name in sys.modules:
        return importlib.reload(sys.modules[name])
    return importlib.import_module(name)


def test_static_transform_edit_changing_only_sample_17_rebuilds_and_says_why(tmp_path, monkeypatch):
    """Sample 17 is not a probe (64 samples: probes 0, 9, 18, ...): only the code hash can see the edit."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    cache = str(tmp_path / "cache")
    mod = _write_module(tmp_path, "fp_edited", _EDITED.replace("{BODY}", "pass"))
    first = mod.Edited(cache_dir=cache, device="cpu", progress=False)
    first.prepare_data()
    first.setup("fit")
    assert int(first.stores["train"].fields[0][17].max()) == 17

    mod = _write_module(tmp_path, "fp_edited", _EDITED.replace(
        "{BODY}", "image = image + 100 if index == 17 else image  # the fix for sample 17"))
    dm = mod.Edited(cache_dir=cache, device="cpu", progress=False)
    with pytest.warns(UserWarning, match="fingerprint differs") as record:
        dm.prepare_data()
    (msg,) = _messages(record)
    assert "code changed" in msg and "fp_edited.Edited.static_transform" in msg
    assert "probe" not in msg  # the probes did not see it: the code did
    dm.setup("fit")
    store = dm.stores["train"]
    assert int(store.fields[0][17].max()) == 117 and int(store.fields[0][16].max()) == 16
    assert store.path != first.stores["train"].path and first.stores["train"].path.exists()  # old one kept
    sys.modules.pop("fp_edited", None)


def test_helper_reached_by_global_name_is_hashed_comments_are_not(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    template = textwrap.dedent('''
        import math  # another module: named with its version, not hashed

        SCALE = {SCALE}

        def helper(x):
            {COMMENT}
            return x * SCALE

        def transform(sample):
            return helper(sample)
    ''')

    def digest(scale: str, comment: str = "") -> str:
        mod = _write_module(tmp_path, "fp_helper", template.replace("{SCALE}", scale).replace("{COMMENT}", comment))
        return Canon().callable(mod.transform)

    base = digest("2")
    assert digest("2", "# a comment only") == base  # bytecode, not text: comments do not rebuild
    assert digest("3") != base  # a module constant the helper reads
    mod = _write_module(tmp_path, "fp_helper", template.replace("{SCALE}", "2").replace("{COMMENT}", ""))
    canon = Canon()
    canon.callable(mod.transform)
    assert set(canon.code) == {"fp_helper.helper", "fp_helper.transform"}
    sys.modules.pop("fp_helper", None)


def test_a_helper_in_another_project_module_is_hashed(tmp_path, monkeypatch):
    """A static transform calling a helper from another file of the project (``from helpers
    import fix``, or ``import helpers`` then ``helpers.fix``): the helper's code was recorded by
    name only, so an edit to it that changed only non-probe samples reused the stale cache,
    silently. The user's code is hashed in whichever module it lives; installed code is not."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    helper = textwrap.dedent('''
        LIMIT = 200

        def fix(x, i):
            {BODY}
            return x
    ''')
    users = {"fp_from_import": "from fp_helpers import fix\n\ndef transform(s):\n    return fix(*s), s[1]\n",
             "fp_module_import": "import numpy as np\nimport fp_helpers\n\n"
                                 "def transform(s):\n    return np.asarray(fp_helpers.fix(*s)), s[1]\n"}

    def digests(body: str) -> dict[str, str]:
        _write_module(tmp_path, "fp_helpers", helper.replace("{BODY}", body))
        return {name: Canon().callable(_write_module(tmp_path, name, text).transform) for name, text in users.items()}

    base = digests("pass")
    assert digests("pass  # a comment only") == base
    edited = digests("x = x * 0 if i == 17 else x")
    assert all(edited[name] != base[name] for name in users)
    canon = Canon()
    canon.callable(_write_module(tmp_path, "fp_module_import", users["fp_module_import"]).transform)
    assert "fp_helpers.fix" in canon.code and not any(name.startswith("numpy") for name in canon.code)
    for name in ("fp_helpers", *users):
        sys.modules.pop(name, None)


class _FromFile(OptimizedDataModule):
    """A source that loads its samples from a file it does not name (no ``source_files``)."""

    def __init__(self, path: str, **kwargs) -> None:
        super().__init__(progress=False, device="cpu", **kwargs)
        self.path = path

    def source(self, split):
        if split != "train":
            return None
        x = torch.from_numpy(np.load(self.path))
        return torch.utils.data.TensorDataset(x, torch.arange(len(x)))


def test_samples_held_in_memory_by_the_source_enter_the_fingerprint(tmp_path):
    """A ``TensorDataset`` loaded inside ``source()`` from a file rewritten with one non-probe
    sample changed (same length): the cache was reused, serving the old sample. Its tensors
    enter the fingerprint now; the unchanged file still reuses the cache."""
    data, cache = tmp_path / "train.npy", str(tmp_path / "cache")
    x = np.arange(50 * 6, dtype=np.uint8).reshape(50, 6)
    np.save(data, x)
    first = _FromFile(str(data), cache_dir=cache)
    first.prepare_data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same file: the cache is reused, nothing to say
        again = _FromFile(str(data), cache_dir=cache)
        again.prepare_data()
    x[5] = 0  # sample 5 is not a probe (50 samples: 0, 7, 14, ...)
    np.save(data, x)
    edited = _FromFile(str(data), cache_dir=cache)
    with pytest.warns(UserWarning, match=r"fingerprint differs.*source changed") as record:
        edited.prepare_data()
    assert "probe" not in _messages(record)[0]
    edited.setup("fit")
    assert edited.stores["train"].fields[0][5].tolist() == [0] * 6


class _Wrapped(OptimizedDataModule):
    """Labels loaded in ``source()`` from a file, held by TensorDataset shards in a ConcatDataset,
    as 20 shards or as 4 shards under two Subsets (three wrappers deep)."""

    def __init__(self, path: str, layout: str, **kwargs) -> None:
        super().__init__(progress=False, device="cpu", **kwargs)
        self.path, self.layout = path, layout

    def source(self, split):
        if split != "train":
            return None
        y = torch.from_numpy(np.load(self.path))
        x = torch.arange(len(y) * 3, dtype=torch.float32).reshape(len(y), 3)
        k = 20 if self.layout == "20 shards" else 4
        per = len(y) // k
        concat = ConcatDataset([TensorDataset(x[i * per:(i + 1) * per], y[i * per:(i + 1) * per]) for i in range(k)])
        if self.layout == "20 shards":
            return concat
        return Subset(Subset(concat, list(range(len(y)))), list(range(len(y))))


@pytest.mark.parametrize("layout", ["20 shards", "3 deep"])
def test_in_memory_samples_of_every_wrapped_dataset_enter_the_fingerprint(layout, tmp_path):
    """Only the labels of the first 16 members, two wrappers deep, were hashed: a label changed
    at sample 185 of 200 (not a probe) in the 20th shard, or under Subset(Subset(ConcatDataset)),
    reused the cache and served the old label."""
    data, cache = tmp_path / "labels.npy", str(tmp_path / "cache")
    y = np.arange(200) % 5
    np.save(data, y)
    _Wrapped(str(data), layout, cache_dir=cache).prepare_data()
    y[185] = 4 - y[185]
    np.save(data, y)
    edited = _Wrapped(str(data), layout, cache_dir=cache)
    with pytest.warns(UserWarning, match=r"fingerprint differs.*source changed \(its attributes differ\)"):
        edited.prepare_data()
    edited.setup("fit")
    assert int(edited.stores["train"].fields[1][185]) == y[185]


def test_a_new_length_says_the_probes_moved_not_that_outputs_changed(cache_dir):
    """40 -> 48 samples moves the probe indices; the one probed both times (0) is unchanged. The
    warning said "static outputs of the probe samples changed (structure, dtype or shape)"."""
    Counting(n=40, cache_dir=str(cache_dir)).prepare_data()
    with pytest.warns(UserWarning, match="fingerprint differs") as record:
        Counting(n=48, cache_dir=str(cache_dir)).prepare_data()
    message = _messages(record)[0]
    assert "source changed (len 40 -> 48); the probe samples moved to other indices (those probed both times are " \
           "unchanged)" in message
    assert "structure, dtype or shape" not in message and "static outputs" not in message


_STABLE = """
import sys
sys.path.insert(0, {tests!r})
from _helpers import CountingDataset
from lightning_fastdata.store import fingerprint

def transform(sample, names=frozenset({{"a", "b", "c"}})):
    image, label = sample
    if label in {{1, 2, 3}} and "a" in names:
        image = image + 1
    return image, label

print(fingerprint(CountingDataset(20), transform, config={{"tags": {{"x", "y", "z"}}, "root": "data"}})[0])
"""


def test_fingerprint_is_the_same_in_every_process(tmp_path):
    """Ranks must agree: set literals and hash randomisation must not move the digest."""
    script = tmp_path / "fp_stable.py"
    script.write_text(_STABLE.format(tests=os.path.dirname(__file__)))
    digests = set()
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONHASHSEED": seed, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr
        digests.add(out.stdout.strip())
    assert len(digests) == 1


def test_mutable_state_does_not_move_the_fingerprint():
    """A counter in a closure, a counter and a lazily opened handle on the source: same digest after reads."""
    seen: list[int] = []

    def transform(sample):
        seen.append(1)
        return sample

    class Lazy(CountingDataset):
        def __getitem__(self, i):
            self.handle = self.handle if getattr(self, "handle", None) else open(os.devnull, "rb")  # noqa: SIM115
            return super().__getitem__(i)

    ds = Lazy(12)
    a = fingerprint(ds, transform)[0]
    b = fingerprint(ds, transform)[0]
    ds.handle.close()
    assert a == b and len(seen) == 16 and ds.calls == 16


# --------------------------------------------------------------------------- init arguments


def test_loader_settings_do_not_change_the_fingerprint_init_arguments_do(cache_dir):
    first = Counting(cache_dir=str(cache_dir))
    first.prepare_data()
    settings = dict(batch_size=3, eval_batch_size=2, strategy="workers", vram_fraction=0.3, shared_memory="off",
                    num_workers=2, pin_memory=False, prefetch_factor=4, persistent_workers=True, shuffle=False,
                    drop_last=True, seed=7, train_augment=A.RandomHorizontalFlip(), eval_augment=A.ToDtype(),
                    progress=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no rebuild warning
        again = Counting(cache_dir=str(cache_dir), **settings)
        again.prepare_data()
    assert again.calls == 8  # only the probes: the cache was reused
    resized = Counting(size=2, cache_dir=str(cache_dir))
    with pytest.warns(UserWarning, match=r"config changed \(size: 4 -> 2\)"):
        resized.prepare_data()
    assert resized.calls == 64 + 2 * 8


class _Shaped(Counting):
    """A ``tuple[int, int]`` argument, as a YAML list reaches it under ``fastdata fit``."""

    def __init__(self, shape: tuple[int, int] = (2, 2), **kwargs) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters(logger=False)


def test_a_tuple_argument_given_as_a_list_finds_the_same_cache(cache_dir):
    """``fastdata plan`` (and Python) pass ``(8, 8)``, ``fastdata fit`` the YAML's ``[8, 8]``:
    the fit rebuilt the cache ("config changed (shape: tuple[8, 8] -> list[8, 8])") and kept two."""
    first = _Shaped(shape=(8, 8), cache_dir=str(cache_dir))
    first.prepare_data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no rebuild warning
        again = _Shaped(shape=[8, 8], cache_dir=str(cache_dir))
        again.prepare_data()
    assert again.calls == 8  # only the probes: the cache was reused
    other = _Shaped(shape=[8, 4], cache_dir=str(cache_dir))
    with pytest.warns(UserWarning, match=r"config changed \(shape: "):
        other.prepare_data()


def test_two_projects_with_a_train_split_keep_both_caches(cache_dir):
    class ProjectA(Counting):
        pass

    class ProjectB(Counting):
        pass

    a, b = ProjectA(cache_dir=str(cache_dir)), ProjectB(cache_dir=str(cache_dir))
    a.prepare_data()
    b.prepare_data()
    a.setup("fit")
    b.setup("fit")
    pa, pb = a.stores["train"].path, b.stores["train"].path
    assert pa.parent != pb.parent and pa.parent.parent == pb.parent.parent == cache_dir
    assert pa.parent.name.endswith("ProjectA") and pb.parent.name.endswith("ProjectB")
    again = ProjectA(cache_dir=str(cache_dir))
    again.prepare_data()
    assert again.calls == 8 and pa.exists() and pb.exists()


# --------------------------------------------------------------------------- files


class Folder(OptimizedDataModule):
    """An ImageFolder of BMP files (fixed size on disk whatever the pixels)."""

    def __init__(self, root: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.root = root

    def source(self, split):
        import torchvision

        return torchvision.datasets.ImageFolder(f"{self.root}/{split}") if split == "train" else None

    def static_transform(self, sample):
        from torchvision.transforms.functional import pil_to_tensor

        image, label = sample
        return pil_to_tensor(image), label


def _bmp(path, value: int) -> None:
    from PIL import Image

    Image.new("RGB", (6, 6), (value, value, value)).save(path, format="BMP")


def test_imagefolder_file_rewritten_in_place_with_the_same_size_rebuilds(tmp_path):
    for c in range(2):
        (tmp_path / "data" / "train" / f"class{c}").mkdir(parents=True)
        for k in range(6):
            _bmp(tmp_path / "data" / "train" / f"class{c}" / f"{k}.bmp", 10 * c + k)
    kwargs = dict(root=str(tmp_path / "data"), cache_dir=str(tmp_path / "cache"), device="cpu", progress=False)
    dm = Folder(**kwargs)
    dm.prepare_data()
    dm.setup("fit")
    # sample 4 is not a probe (12 samples: probes 0, 2, 3, 5, ...): only its mtime can tell
    path = dm.source("train").samples[4][0]
    before = os.stat(path)
    time.sleep(0.01)
    _bmp(path, 250)
    after = os.stat(path)
    assert after.st_size == before.st_size and after.st_mtime_ns != before.st_mtime_ns
    dm2 = Folder(**kwargs)
    with pytest.warns(UserWarning, match="source files changed") as record:
        dm2.prepare_data()
    assert "a file was modified" in _messages(record)[0] and "probe" not in _messages(record)[0]
    dm2.setup("fit")
    assert int(dm2.stores["train"].fields[0][4].max()) == 250
    assert dm2.stores["train"].meta["fingerprint_components"]["files"]["count"] == 12


class LabelsFile(Dataset):
    """Reads its labels from a text file it does not list as an attribute (only the hook can tell)."""

    def __init__(self, path: str) -> None:
        self._open = lambda: open(path)  # noqa: SIM115

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int):
        with self._open() as f:
            labels = [int(x) for x in f.read().split()]
        return np.full((2,), i, np.uint8), labels[i]


class Hooked(OptimizedDataModule):
    def __init__(self, labels: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.labels = labels

    def source(self, split):
        return LabelsFile(self.labels) if split == "train" else None

    def source_files(self, split):
        return [self.labels]


def test_source_files_hook_lists_what_the_source_reads(tmp_path):
    labels = tmp_path / "labels.txt"
    labels.write_text(" ".join("0" * 20))
    kwargs = dict(labels=str(labels), cache_dir=str(tmp_path / "cache"), device="cpu", progress=False)
    Hooked(**kwargs).prepare_data()
    time.sleep(0.01)
    labels.write_text(" ".join("0" * 10 + "1" + "0" * 9))  # sample 10 (not a probe) gets label 1
    dm = Hooked(**kwargs)
    with pytest.warns(UserWarning, match="source files changed"):
        dm.prepare_data()
    dm.setup("fit")
    assert int(dm.stores["train"].fields[1][10]) == 1


def test_discover_files_on_imagefolder_subset_and_lists(tmp_path):
    import torchvision

    for c in range(2):
        (tmp_path / f"c{c}").mkdir()
        for k in range(3):
            _bmp(tmp_path / f"c{c}" / f"{k}.bmp", k)
    folder = torchvision.datasets.ImageFolder(str(tmp_path))
    expected = [p for p, _ in folder.samples]
    assert discover_files(folder) == expected  # samples and imgs: listed once
    assert discover_files(Subset(folder, [0, 1])) == expected

    class Paths(Dataset):
        def __init__(self):
            self.files = [str(p) for p in sorted(tmp_path.glob("c0/*.bmp"))]
            self.names = ["not", "paths"]

    assert discover_files(Paths()) == [str(p) for p in sorted(tmp_path.glob("c0/*.bmp"))]
    assert discover_files(CountingDataset(3)) == []
    # three wrappers deep (and the 17th member of a ConcatDataset): searched only two levels deep before
    deep = Subset(Subset(ConcatDataset([CountingDataset(1)] * 16 + [folder]), [0]), [0])
    assert discover_files(deep) == expected


# --------------------------------------------------------------------------- random sources


class Noisy(Counting):
    def static_transform(self, sample):
        image, index = sample
        return image + torch.randint(0, 2, image.shape, dtype=torch.uint8), index


def test_random_static_transform_warns_once_naming_the_field(cache_dir):
    dm = Noisy(cache_dir=str(cache_dir))
    with pytest.warns(UserWarning) as record:
        dm.prepare_data()
    random = [m for m in _messages(record) if "differs between two reads" in m]
    assert len(random) == 1
    assert random[0].startswith("lightning_fastdata: field '0' of sample 0 differs between two reads of the same "
                                "index: the source or static_transform is random")
    assert "train_augment" in random[0] and "store=False" in random[0]


def test_a_dataset_passed_as_an_init_argument_enters_by_class_length_and_construction_attributes(cache_dir):
    class Given(OptimizedDataModule):
        def __init__(self, dataset, **kwargs):
            super().__init__(progress=False, device="cpu", **kwargs)
            self.dataset = dataset

        def source(self, split):
            return self.dataset if split == "train" else None

    ds = Indexed(30)
    dm = Given(ds, cache_dir=str(cache_dir))
    dm.prepare_data()  # ds.calls grows: the fingerprint must not move with it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dm.setup("fit")
    assert len(list(dm.stores["train"].path.parent.glob("train-*"))) == 1
    assert "Indexed[30]" in dm.stores["train"].meta["fingerprint_components"]["config"]["dataset"]


class _Labelled(Dataset):
    """Images with labels held in memory as ``targets`` (as torchvision's datasets)."""

    def __init__(self, targets) -> None:
        self.targets = targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        return torch.full((2,), i, dtype=torch.uint8), int(np.sum(self.targets[i]))


@pytest.mark.parametrize("kind", ["numpy scalars", "lists", "ragged lists", "array"])
def test_labels_held_in_memory_enter_the_fingerprint_whatever_their_type(kind):
    """Only sample 3's label changes (not a probe). A list of numpy scalars (``list(array)``) or
    of lists (multi-label) was left out of the fingerprint: the stale cache was reused."""
    def targets(third):
        labels = [i % 4 for i in range(40)]
        labels[3] = third
        if kind == "numpy scalars":
            return list(np.asarray(labels))
        if kind == "lists":
            return [[v, v + 1] for v in labels]
        if kind == "ragged lists":
            return [[v] * (1 + i % 3) for i, v in enumerate(labels)]
        return np.asarray(labels)

    first = fingerprint(_Labelled(targets(3)), lambda s: s, probes=4)[0]
    assert fingerprint(_Labelled(targets(3)), lambda s: s, probes=4)[0] == first
    assert fingerprint(_Labelled(targets(9)), lambda s: s, probes=4)[0] != first


def _prep_class(bad: int) -> type:
    """A helper class ``Prep`` of the project, whose rare branch writes ``bad``."""
    ns = {"__name__": __name__}
    exec(textwrap.dedent(f"""
        class Prep:
            def __call__(self, sample):
                image, label = sample
                return (image * 0 + {bad}, label) if label == 5 else (image, label)
    """), ns)
    return ns["Prep"]


class _WithHelper:
    def __init__(self, prep) -> None:
        self.prep = prep  # a helper object set on the instance, not the class

    def static_transform(self, sample):
        return self.prep(sample)


def test_the_code_of_a_helper_object_held_by_the_data_module_is_hashed():
    """``self.prep = Prep()`` in ``__init__``, ``self.prep(sample)`` in ``static_transform``: an edit
    of Prep's code that changes only a non-probe sample reused the cache (only ``.prep`` was hashed)."""
    data = CountingDataset(40, classes=40)
    first = fingerprint(data, _WithHelper(_prep_class(5)()).static_transform, probes=4)[0]
    assert fingerprint(data, _WithHelper(_prep_class(5)()).static_transform, probes=4)[0] == first
    assert fingerprint(data, _WithHelper(_prep_class(6)()).static_transform, probes=4)[0] != first


# --------------------------------------------------------------------------- the data module's own code and values


_DM_TEMPLATE = '''
import functools

import torch
from torch.utils.data import Dataset

from lightning_fastdata import OptimizedDataModule
{PRE}

class Src(Dataset):
    def __init__(self, clip=None):
        self.clip = clip  # not a SOURCE_ATTRIBUTES name: only source()'s code shows it

    def __len__(self):
        return 100

    def __getitem__(self, i):
        x = torch.full((4,), 1000.0 if i == 17 else float(i % 10))
        return x.clamp(max=self.clip) if self.clip is not None else x


class DM(OptimizedDataModule):
    def __init__(self, **kwargs):
        super().__init__(progress=False, device="cpu", **kwargs)
        {INIT}

    def source(self, split):
        return {SOURCE} if split == "train" else None

    def static_transform(self, s):
        return {BODY}
'''
# 100 samples, probes 0, 14, 28, ...: only sample 17 exceeds the clip, so only code and values can see it.
_DM_VARIANTS = {
    "source_arg": dict(SOURCE="Src(clip={v})", BODY="s"),
    "inst_attr": dict(INIT="self.clip = {v}", BODY="s.clamp(max=self.clip)"),
    "helper_obj": dict(PRE="class Prep:\n    def __init__(self, c):\n        self.c = c\n\n"
                           "    def __call__(self, s):\n        return s.clamp(max=self.c)\n",
                       INIT="self.prep = Prep({v})", BODY="self.prep(s)"),
    "compose_clamp": dict(PRE="import torchvision.transforms.v2 as T\n",
                          INIT="self.tf = T.Compose([T.Lambda(functools.partial(torch.clamp, max={v}))])",
                          BODY="self.tf(s)"),
}


@pytest.mark.parametrize("variant", sorted(_DM_VARIANTS))
def test_a_constant_edited_in_the_data_modules_init_or_source_rebuilds(variant, tmp_path, monkeypatch):
    """A constant in the data module's ``__init__`` or ``source`` edited from 500 to 600 (only sample 17,
    not a probe, changes): the old cache was reused silently (only static_transform and the source's
    class were hashed, ``self.clip`` by name), serving 500 where the code gives 600."""
    if variant == "compose_clamp":
        pytest.importorskip("torchvision")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    name = f"fp_dm_{variant}"
    parts = {"PRE": "", "INIT": "pass", "SOURCE": "Src()", **_DM_VARIANTS[variant]}
    cache = str(tmp_path / "cache")

    def build(value: int):
        text = _DM_TEMPLATE
        for key, part in parts.items():
            text = text.replace("{" + key + "}", part.replace("{v}", str(value)))
        dm = _write_module(tmp_path, name, text).DM(cache_dir=cache)
        dm.prepare_data()
        dm.setup("fit")
        return dm

    first = build(500)
    assert float(first.stores["train"].fields[0][17][0]) == 500
    with pytest.warns(UserWarning, match="fingerprint differs") as record:
        dm = build(600)
    (msg,) = _messages(record)
    assert f"{name}.DM." in msg or "self." in msg  # it says what changed
    assert float(dm.stores["train"].fields[0][17][0]) == 600 and float(dm.stores["train"].fields[0][16][0]) == 6
    assert dm.stores["train"].path != first.stores["train"].path
    sys.modules.pop(name, None)


class _Popped(Counting):
    """An argument taken from ``**kwargs`` (so not an init parameter ``_cache_config`` sees) and saved
    in ``hparams``; the loader settings kept as attributes too, as Lightning's tutorial writes them."""

    def __init__(self, **kwargs) -> None:
        clip = kwargs.pop("clip", 500)
        super().__init__(**kwargs)
        self.save_hyperparameters({"clip": clip})
        self.batch_size, self.num_workers = kwargs.get("batch_size", 1), kwargs.get("num_workers", "auto")
        self.scratch = f"/tmp/scratch-{id(self)}"  # differs per process (and rank): never read by the fingerprint

    def static_transform(self, sample):
        self.calls += 1
        image, i = sample
        return (image.clamp(max=self.hparams["clip"] - 400) if i == 17 else image), i


def test_a_value_saved_in_hparams_rebuilds_loader_settings_and_other_attributes_do_not(cache_dir):
    """``DM(clip=500)`` then ``DM(clip=600)`` (``--data.clip 600``) with the value taken from
    ``**kwargs`` into ``hparams``: the same cache was reused (found by a review helper). Loader
    settings kept as attributes (``self.batch_size = batch_size``) and a per-process value set in
    ``__init__`` must not rebuild (a first fix that hashed every attribute did: found by a review
    helper)."""
    first = _Popped(cache_dir=str(cache_dir))
    first.prepare_data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no rebuild
        again = _Popped(cache_dir=str(cache_dir), batch_size=3, num_workers=2, strategy="workers", seed=7)
        again.prepare_data()
    assert again.calls == 8  # only the probes: reused
    edited = _Popped(clip=600, cache_dir=str(cache_dir))
    with pytest.warns(UserWarning, match=r"config changed \(clip: 500 -> 600\)"):
        edited.prepare_data()
    assert edited.calls == 64 + 2 * 8  # rebuilt


_GLOBALS = {
    "namedtuple": ("import typing\n\nclass Cfg(typing.NamedTuple):\n    clip: int\n\nCFG = Cfg({v})\n", "CFG.clip"),
    "frozen_dataclass": ("import dataclasses\n\n@dataclasses.dataclass(frozen=True)\nclass Cfg:\n    clip: int\n\n"
                         "CFG = Cfg({v})\n", "CFG.clip"),
    "ndarray": ("LUT = np.array([0, {v}])\n", "int(LUT[1])"),
    "tensor": ("LUT = torch.tensor([0, {v}])\n", "int(LUT[1])"),
    "numpy_scalar": ("CLIP = np.int64({v})\n", "int(CLIP)"),
}


@pytest.mark.parametrize("kind", sorted(_GLOBALS))
def test_immutable_module_globals_and_small_tables_enter_by_value(kind, tmp_path, monkeypatch):
    """A module-level NamedTuple, frozen dataclass, numpy scalar or small array/tensor (a label remap
    table) read by the static transform entered by type only: editing 500 to 600, seen by sample 17
    alone (not a probe), kept the same fingerprint."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    pre, read = _GLOBALS[kind]
    template = ("import numpy as np\nimport torch\n\n" + pre + "\n\ndef transform(s):\n    image, i = s\n"
                f"    return (image * 0 + {read} % 256 if i == 17 else image), i\n")
    name = f"fp_global_{kind}"

    def digest(value: int) -> str:
        return fingerprint(Indexed(40), _write_module(tmp_path, name, template.replace("{v}", str(value))).transform,
                           probes=4)[0]

    base = digest(500)
    assert digest(500) == base and digest(600) != base
    sys.modules.pop(name, None)


def test_a_module_level_array_over_the_limit_enters_by_type_only(tmp_path, monkeypatch):
    """The documented limit (docs/cache.md): an array over ``MAX_GLOBAL_ARRAY`` is not hashed."""
    from lightning_fastdata.fingerprint import MAX_GLOBAL_ARRAY

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    template = (f"import numpy as np\n\nBIG = np.full({MAX_GLOBAL_ARRAY // 8 + 1}, {{v}}, dtype=np.int64)\n\n"
                "def transform(s):\n    image, i = s\n"
                "    return (image * 0 + int(BIG[0]) % 256 if i == 17 else image), i\n")

    def digest(value: int) -> str:
        return fingerprint(Indexed(40), _write_module(tmp_path, "fp_global_big", template.replace("{v}", str(value)))
                           .transform, probes=4)[0]

    assert digest(500) == digest(600)
    sys.modules.pop("fp_global_big", None)
