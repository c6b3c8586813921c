"""The profiler's report: pure functions of the recorded rows and of what is known of the pipeline.

:func:`summarize` turns rows (see :mod:`~lightning_fastdata.step_timer`) into totals, shares
and percentiles; :func:`verdict_of` names what bounds the step; :func:`advise` says what to
change; :func:`format_report` prints it. Nothing here reads a clock, a Trainer or a device.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lightning_fastdata._util import fmt_bytes
from lightning_fastdata.plan import _budget
from lightning_fastdata.step_timer import COMPUTE, FETCH, IDLE, OVERHEAD, STEP, TRANSFER, WAIT, WIDTH

_FIGURES = (("step", STEP), ("data_wait", WAIT), ("compute", COMPUTE), ("overhead", OVERHEAD))
#: A data wait at or above this share of the step gets data-loading advice.
DATA_ADVICE_FRAC = 0.10
#: Framework overhead at or above this share of the step gets its own advice.
OVERHEAD_ADVICE_FRAC = 0.25
#: A GPU idle at least this share of its time, with the host's own work explaining more of it than
#: loading does, is host-bound (see :func:`verdict_of`).
HOST_IDLE_FRAC = 0.10


def summarize(rows: Sequence[Sequence[float]]) -> dict[str, Any]:
    """Totals, shares, and mean/p50/p95 in ms of step, data wait, compute and overhead (rows of 8 columns)."""
    out: dict[str, Any] = {"steps": len(rows)}
    # fromiter over the flat rows: np.asarray would inspect every float of every row (epoch end, all rows).
    flat = itertools.chain.from_iterable(rows)
    arr = np.fromiter(flat, dtype=np.float64, count=len(rows) * WIDTH).reshape(len(rows), WIDTH)
    total = float(arr[:, STEP].sum())
    for name, col in _FIGURES:
        v = arr[:, col]
        out[f"{name}_s"] = float(v.sum())
        out[f"{name}_ms_mean"] = 1e3 * float(v.mean()) if len(v) else 0.0
        out[f"{name}_ms_p50"] = 1e3 * float(np.percentile(v, 50)) if len(v) else 0.0
        out[f"{name}_ms_p95"] = 1e3 * float(np.percentile(v, 95)) if len(v) else 0.0
    for name, col in (("fetch", FETCH), ("transfer", TRANSFER)):
        out[f"{name}_ms_mean"] = 1e3 * float(arr[:, col].mean()) if len(rows) else 0.0
    for name in ("data_wait", "compute", "overhead"):
        out[f"{name}_frac"] = out[f"{name}_s"] / total if total > 0 else 0.0
    idle = arr[:, IDLE]
    if len(rows) and not np.isnan(idle).all():
        busy = float(np.nansum(idle)) + out["compute_s"]
        out["gpu_idle_frac"] = float(np.nansum(idle)) / busy if busy > 0 else 0.0
    return out


def data_on_device(context: Mapping[str, Any] | None) -> bool:
    """Whether the whole dataset sits on the training device (strategy ``device``)."""
    context = context or {}
    loader = context.get("loader") or {}
    return getattr(context.get("plan"), "strategy", None) == "device" or loader.get("kind") == "device"


def host_share(summary: Mapping[str, Any], on_device: bool) -> float:
    """Share of the step the host spends on its own work rather than waiting for data.

    Framework overhead (callbacks, logging, the model's own launches beyond device compute),
    plus, when the data is on the device, the whole data wait: there the batch gather and
    the augmentation are kernels being launched, not data being loaded.
    """
    return summary["overhead_frac"] + (summary["data_wait_frac"] if on_device else 0.0)


def verdict_of(summary: Mapping[str, Any], context: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What bounds the step, with its share of the step.

    * ``host-bound``: the GPU idles at least ``HOST_IDLE_FRAC`` of its time and the host's
      own work (:func:`host_share`) is at least the real data wait (a wait off the device);
      where no GPU idle is measured (a CPU run), the framework overhead is at least
      ``OVERHEAD_ADVICE_FRAC`` of the step and more than both data wait and compute;
    * ``data-bound``: the data wait exceeds compute;
    * ``compute-bound`` otherwise.

    Args:
        summary: A stage summary from :func:`summarize`.
        context: What :func:`advise` gets; ``plan``/``loader`` say whether the data is on the device.
    """
    if not summary.get("steps"):
        return {"verdict": "no steps", "share": 0.0}
    on_device = data_on_device(context)
    host = host_share(summary, on_device)
    loading = 0.0 if on_device else summary["data_wait_frac"]
    idle = summary.get("gpu_idle_frac")
    if idle is not None and idle >= HOST_IDLE_FRAC and host > 0 and host >= loading:
        return {"verdict": "host-bound", "share": host}
    overhead = summary["overhead_s"]
    if (idle is None and summary["overhead_frac"] >= OVERHEAD_ADVICE_FRAC
            and overhead > summary["data_wait_s"] and overhead > summary["compute_s"]):
        # No device idle to measure: the host's own work is the largest part of the step itself
        # (a callback's batch hook, logging), which neither the loader nor the model speeds up.
        return {"verdict": "host-bound", "share": summary["overhead_frac"]}
    if summary["data_wait_s"] > summary["compute_s"]:
        return {"verdict": "data-bound", "share": summary["data_wait_frac"]}
    return {"verdict": "compute-bound", "share": summary["compute_frac"]}


def advise(summary: Mapping[str, Any], context: Mapping[str, Any], stage: str = "train") -> list[str]:
    """Concrete advice from the measured shares and what is known of the input pipeline.

    Args:
        summary: A stage summary (:func:`summarize` plus :func:`verdict_of`; ``augment_ms_mean``, where
            the data module's loader augmentation was timed).
        context: ``plan`` (a :class:`~lightning_fastdata.plan.Plan` or None),
            ``vram_fraction``, ``loader`` (:func:`loader_info`), ``cores`` (CPU cores per local
            rank) and ``device_type``.
        stage: "train" or "validate": which augmentation the advice names.
    """
    w, c, o = summary["data_wait_frac"], summary["compute_frac"], summary["overhead_frac"]
    wait_ms, transfer_ms = summary["data_wait_ms_mean"], summary["transfer_ms_mean"]
    augment = "train_augment" if stage == "train" else "eval_augment"
    plan, loader = context.get("plan"), context.get("loader") or {}
    cores = int(context.get("cores") or 1)
    cuda = context.get("device_type") == "cuda"
    on_device = data_on_device(context)
    idle = summary.get("gpu_idle_frac")
    # host-bound on a GPU: the device idles while the host launches work; without a measured idle
    # (a CPU run): the framework overhead is the largest part of the step.
    host_bound = summary.get("verdict") == "host-bound" and idle is not None
    overhead_bound = summary.get("verdict") == "host-bound" and idle is None
    restarting = bool(loader.get("num_workers")) and not loader.get("persistent_workers")
    advice: list[str] = []
    if overhead_bound:
        # Lightning restarts non-persistent workers at each epoch's start, outside the timed fetch.
        workers = (f"the DataLoader's {loader['num_workers']} workers restart at every epoch "
                   "(persistent_workers=False), which counts there: set persistent_workers=True; then "
                   if restarting else "")
        advice.append(f"host-bound: framework overhead is {o:.0%} of the step (callbacks' batch hooks, logging, "
                      f"loop bookkeeping), more than compute ({c:.0%}) and data wait ({w:.0%}): {workers}lighten "
                      "or thin out the per-batch work of callbacks and of the module's batch hooks, raise "
                      "log_every_n_steps, or use a larger batch (fewer steps for the same data)")
    if host_bound:
        parts = []
        if on_device and w > 0:
            parts.append(f"the batch gather and on-device augmentation take {wait_ms:.1f} ms a step ({w:.0%})")
        if o > 0:
            parts.append(f"framework overhead and the model's own launches {o:.0%}")
        advice.append(f"host-bound: the GPU is idle {idle:.0%} of the time while the host launches work ("
                      + "; ".join(parts) + "): fewer, larger launches help: a larger batch, CUDA graphs, "
                      "torch.compile")
    lead = f"data wait is {w:.0%} of the step"
    if w >= DATA_ADVICE_FRAC:
        strategy = getattr(plan, "strategy", None)
        resources = getattr(plan, "resources", None)
        store = int(getattr(plan, "store_nbytes", 0) or 0)
        stays_on_host = False  # the planner would refuse strategy=device for this store
        gather_costs = True  # moving the store to the device could cut the wait
        if not on_device and loader.get("augments"):
            # A chunked store's loader gathers each batch from host memory, then augments it, both
            # in its fetch (or ahead of the step in its thread): the wait was blamed on the store's
            # placement alone, and strategy=device changed nothing when the augmentation was the cost.
            fetch_ms, step_ms = summary["fetch_ms_mean"], summary["step_ms_mean"]
            aug_ms = summary.get("augment_ms_mean")
            where = (f"{lead}: the loader's fetch ({fetch_ms:.1f} ms a step) gathers each batch from host memory "
                     f"and applies {augment}")
            if aug_ms is None:  # not timed (the fallback timing): which part costs is unknown
                advice.append(f"{where}: use a lighter {augment} if it is the cost")
            else:
                # Ahead of the step the augmentation overlaps the step: the wait left is counted as
                # the augmentation's first, as far as it goes, then the gather's.
                aug_wait = min(aug_ms, fetch_ms)
                gather_costs = fetch_ms - aug_wait >= DATA_ADVICE_FRAC * step_ms
                if aug_wait >= DATA_ADVICE_FRAC * step_ms:
                    advice.append(f"{where} ({aug_ms:.1f} ms a batch): use a lighter {augment}"
                                  + ("" if gather_costs else f" (the gather's {fetch_ms - aug_wait:.1f} ms is not "
                                                             "worth moving the store to the device)"))
        if on_device:
            if not host_bound:
                # The data module's loader gathers and augments in its fetch (ahead of the step
                # with augment_ahead); the transfer holds the batch hooks (and an augmentation a
                # model hook before the transfer keeps there).
                fetch_ms = summary["fetch_ms_mean"]
                # augment_ahead only where it is off and pays: on a CPU run the background thread
                # competes with the step for the cores and the GIL (docs/placement.md).
                ahead = (", or augment_ahead=1 to prepare the next batch during the step"
                         if cuda and not loader.get("ahead") else "")
                advice.append(f"{lead}, with the data already on the device: the wait is the batch gather and "
                              f"on-device augmentation, {wait_ms:.1f} ms a step ({fetch_ms:.1f} in the loader's "
                              f"fetch, where the data module gathers and augments, {transfer_ms:.1f} in the "
                              f"transfer and batch hooks): use a lighter {augment}"
                              + (f", a larger batch{ahead}" if ahead else " or a larger batch"))
        elif strategy in ("workers", "chunked") and store and resources is not None and gather_costs:
            vf = float(context.get("vram_fraction") or 0.6)
            what = "GPU" if resources.device_type == "cuda" else "device"
            total = resources.device_total
            # The planner's own budget (the fraction of total, bounded by free memory less a
            # margin): advice it would refuse is no advice.
            budget, why = _budget(resources, vf)
            if store <= budget:
                advice.append(f"{lead}; the store ({fmt_bytes(store)}) fits {vf:.0%} of this {what}'s "
                              f"{fmt_bytes(total)}: set strategy=device")
            elif store <= vf * total:
                stays_on_host = True
                advice.append(f"{lead}; the store ({fmt_bytes(store)}) fits {vf:.0%} of this {what}'s "
                              f"{fmt_bytes(total)} but not its free memory (budget {fmt_bytes(budget)}: {why}), "
                              "so it stays on the host; free device memory to move it there")
            else:
                stays_on_host = True
                advice.append(f"{lead}; the store ({fmt_bytes(store)}) is more than {vf:.0%} of this "
                              f"{what}'s {fmt_bytes(total)}, so it stays on the host")
        nw = loader.get("num_workers")
        if not on_device and nw is not None:
            # Workers fetch batches; a wait spent in the transfer (or in a batch hook after it) is
            # none of theirs: worker advice only when the fetch itself is a real share of the step.
            fetch = summary["fetch_ms_mean"] / summary["step_ms_mean"] if summary["step_ms_mean"] > 0 else 0.0
            if fetch >= DATA_ADVICE_FRAC:
                advice += _worker_advice(f"{lead} (fetching batches {fetch:.0%})", nw, cores, plan is not None)
            if cuda and not loader.get("pin_memory"):
                advice.append("set pin_memory=True: host-to-device copies come from pageable memory")
        if wait_ms > 0 and transfer_ms > 0.5 * wait_ms and strategy != "device":
            # Where the store cannot move to the device, only the augmentation is left to change.
            fix = "lighten the augmentation" if stays_on_host else \
                "keep the data on the device (strategy=device) or lighten the augmentation"
            advice.append(f"transfer and on-device augmentation take {transfer_ms:.1f} of the {wait_ms:.1f} ms "
                          f"wait: {fix}")
    if summary.get("verdict") == "compute-bound":
        model = "mixed precision, a larger batch, torch.compile"
        advice.append(f"compute-bound: compute is {c:.0%} of the step, data wait {w:.0%}; "
                      + (f"the input pipeline keeps up: speed now comes from the model ({model})"
                         if w < DATA_ADVICE_FRAC else
                         f"speed comes first from the model ({model}), then from the data advice above"))
    if o >= OVERHEAD_ADVICE_FRAC and not overhead_bound:  # host-bound on a CPU: said first
        if restarting:
            # Lightning restarts the workers at each epoch's start, outside the timed fetch.
            advice.append(f"framework overhead is {o:.0%} of the step, and the DataLoader's "
                          f"{loader['num_workers']} workers restart at every epoch (persistent_workers=False), "
                          "which counts there: set persistent_workers=True; then raise log_every_n_steps or "
                          "the batch size if it stays")
        else:
            advice.append(f"framework overhead is {o:.0%} of the step (logging, callbacks, loop bookkeeping): "
                          "raise log_every_n_steps or the batch size")
    if idle is not None and idle >= DATA_ADVICE_FRAC and not host_bound:
        advice.append(f"the GPU is idle {idle:.0%} of the time between steps")
    return advice


def _worker_advice(lead: str, nw: int, cores: int, planned: bool) -> list[str]:
    if nw == 0:
        fix = "" if planned else " or cache the preprocessing with OptimizedDataModule"
        return [f"{lead}; batches are loaded in the main process (num_workers=0): set "
                f"num_workers={max(1, cores - 1)}{fix}"]
    if nw >= cores:
        return [f"workers are saturated: {nw} of {cores} cores; more workers cannot help: cache the static "
                "preprocessing (OptimizedDataModule) and move augmentation to the device"]
    if nw + 1 >= cores:
        return [f"workers are saturated: {nw} workers + the main process on {cores} cores; cache the static "
                "preprocessing and move augmentation to the device"]
    return [f"{lead}; {nw} workers on {cores} cores: raise num_workers to {cores - 1}"]


def format_report(report: Mapping[str, Any]) -> str:
    """The report as text: per stage, the figures, the verdict and the advice; then replay and trace."""
    lines = ["lightning_fastdata profile"]
    if report.get("timing") == "hooks":
        lines.append("  timed with public batch hooks (Lightning's loop internals were not found): the wait "
                     "includes other callbacks' batch-start work; overhead is not separated")
    for name, s in report["stages"].items():
        if not s["steps"]:
            continue
        lines.append(f"  {name}: {s['steps']} steps, step p50 {s['step_ms_p50']:.1f} ms "
                     f"(p95 {s['step_ms_p95']:.1f}); data wait {s['data_wait_ms_mean']:.1f} ms "
                     f"({s['data_wait_frac']:.0%}), compute {s['compute_ms_mean']:.1f} ms "
                     f"({s['compute_frac']:.0%}), overhead {s['overhead_ms_mean']:.1f} ms "
                     f"({s['overhead_frac']:.0%})"
                     + (f", GPU idle {s['gpu_idle_frac']:.0%}" if "gpu_idle_frac" in s else ""))
        lines.append(f"    verdict: {s['verdict']} ({s['share']:.0%})")
        lines += [f"    - {a}" for a in s["advice"]]
    r = report.get("replay")
    if r:
        line = f"  replay: compute-only step {r['step_ms']:.1f} ms over {r['steps']} steps"
        if "real_step_ms" in r:
            line += f"; real loader {r['real_step_ms']:.1f} ms ({r['slowdown']:.2f}x the speed of light)"
        lines.append(line)
    t = report.get("trace")
    if t:
        lines.append(f"  trace: {t['path']} (training steps {t['first_step']} to {t['last_step']}; open it in "
                     "https://ui.perfetto.dev or chrome://tracing)")
    return "\n".join(lines)


def loader_info(loader: Any) -> dict[str, Any]:
    """``kind``, ``num_workers``, ``pin_memory``, ``persistent_workers`` of a loader (first of several);
    for an index loader, ``kind``, ``ahead`` and ``augments``."""
    if isinstance(loader, Mapping):
        loader = next(iter(loader.values()), None)
    elif isinstance(loader, (list, tuple)):
        loader = loader[0] if loader else None
    if loader is None:
        return {}
    kind = getattr(getattr(loader, "source", None), "kind", None)
    if kind in ("device", "chunked"):  # the index loader over a device or chunked source
        # augments: it augments each batch in its fetch (an OptimizedDataModule's loader hook).
        return {"kind": kind, "ahead": int(getattr(loader, "ahead", 0) or 0),
                "augments": getattr(loader, "prepare", None) is not None}
    dl = getattr(loader, "dataloader", loader)
    if not hasattr(dl, "num_workers"):
        return {"kind": type(loader).__name__}
    return {"kind": "dataloader", "num_workers": int(dl.num_workers),
            "pin_memory": bool(getattr(dl, "pin_memory", False)),
            "persistent_workers": bool(getattr(dl, "persistent_workers", False))}
