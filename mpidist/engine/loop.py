"""The training loop: datasets, strategy, epochs of steps, evaluation, metrics, checkpoints, plot.

It is the same for every strategy: the Strategy (strategy.base) does the parallel work; the
loop feeds each rank its rows of every global batch and records what comes back.

Checkpoints: when [checkpoint] interval > 0, dir is set, or resume = true, the loop makes a
checkpoint.hook.CheckpointHook(config, comm), then
    hook.attach(strategy)                before training
    hook.resume(strategy) -> bool        before training, if checkpoint.resume (collective)
    hook.after_step(strategy, last)      after every step; the hook decides when to save
    hook.close()                         at the end
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time

from tqdm import tqdm

from mpidist.checkpoint.hook import CheckpointHook
from mpidist.collectives import flight, select
from mpidist.data import DistributedSampler, build_datasets, iterate
from mpidist.engine.plot import plot_run
from mpidist.engine.strategies import build_strategy
from mpidist.errors import ConfigError, agree_or_raise, format_failures
from mpidist.ft.recovery import Resilience
from mpidist.strategy.metrics import MetricsWriter

__all__ = ["run", "evaluate", "total_steps", "agreed_call", "JobFailed"]

log = logging.getLogger("mpidist")


def total_steps(config: dict, n_train: int) -> tuple[int, int]:
    """(steps per epoch, total steps) for a training set of n_train samples."""
    d, j = config["data"], config["job"]
    per_epoch = n_train // d["batch_size"] if d["drop_last"] else -(-n_train // d["batch_size"])
    if per_epoch < 1:
        raise ValueError(f"[data] batch_size = {d['batch_size']} exceeds the {n_train} training samples "
                         "(with drop_last = true no batch is left)")
    return per_epoch, (j["steps"] if j["steps"] > 0 else j["epochs"] * per_epoch)


def _checkpoint_hook(config: dict, comm) -> CheckpointHook | None:
    """Collective: the checkpoint hook, or None when the job asks for no checkpoints."""
    c = config["checkpoint"]
    if not (c["interval"] > 0 or c["dir"] or c["resume"]):
        return None
    return CheckpointHook(config, comm)


class JobFailed(RuntimeError):
    """A set-up step failed on some rank; raised on every rank with every rank's message."""


def agreed_call(comm, fn, *args):
    """fn(*args), called on every rank; if it fails anywhere, raise on every rank.

    A ConfigError anywhere becomes a ConfigError everywhere; other failures JobFailed, which
    names the failing ranks and their messages.
    """
    result, error = None, None
    try:
        result = fn(*args)
    except Exception as exc:
        error = exc
    try:
        agree_or_raise(comm, error, JobFailed)
    except Exception as exc:
        failures = getattr(exc, "failures", [])
        config = [msg for _, kind, msg in failures if kind == ConfigError.__name__]
        if config:
            raise (exc if isinstance(exc, ConfigError) else ConfigError(config[0])) from None
        raise (exc if exc is not error else JobFailed(format_failures(failures))) from error
    return result


# ranks that see different data would run different numbers of steps and hang
_SAME_DATA = ("every rank must read the same dataset (a node-local copy that differs, or a "
              "relative [data] path read from different directories?)")


def _data_file_size(config: dict) -> int | None:
    """The size of the file a rank reads its data from (None: data generated collectively),
    compared across ranks before any rank opens it with collective MPI-IO."""
    path = config["data"]["path"]
    return os.path.getsize(path) if config["data"]["dataset"] in ("hdf5", "text") and path and \
        os.path.exists(path) else None


def evaluate(strategy, dataset, batch_size: int) -> dict:
    """Loss and accuracy over a whole split, every rank reading its rows of each batch."""
    sampler = DistributedSampler(dataset.n, batch_size, rank=strategy.data_rank, size=strategy.data_size,
                                 shuffle=False, drop_last=False)
    loss = correct = count = 0
    for x, y, _ in iterate(dataset, sampler):
        r = strategy.evaluate(x, y)
        loss, correct, count = loss + r["loss"], correct + r["correct"], count + r["count"]
    return {"loss": loss / max(count, 1), "accuracy": correct / max(count, 1), "count": count}


def run(config: dict, comm) -> dict:
    """Collective: train as configured; returns the summary (also written to summary.json)."""
    t_start = time.perf_counter()
    if config["parallel"]["algorithm_table"]:                    # auto's decision table
        select.use_table(config["parallel"]["algorithm_table"])
    comm.check_same(_data_file_size(config), "the dataset file's size in bytes", _SAME_DATA)
    train, test, meta = agreed_call(comm, build_datasets, config, comm)
    try:
        if config["job"]["fault_tolerance"] == "shrink":      # survive a lost rank (mpidist.ft)
            return Resilience(config, comm).run(_train, config, train, test, meta, t_start)
        return _train(config, comm, train, test, meta, t_start)
    finally:                      # parallel HDF5 files must be closed before MPI finalises
        train.close()
        test.close()


def _train(config: dict, comm, train, test, meta: dict, t_start: float, resilience=None) -> dict:
    job = config["job"]
    out_dir = job["out_dir"]
    comm.check_same((train.n, test.n), "the dataset's size (train, test samples)", _SAME_DATA)
    per_epoch, total = agreed_call(comm, total_steps, config, train.n)
    flight.set_directory(out_dir)
    if job["timeout"] is not None and "MPIDIST_TIMEOUT" not in os.environ:
        flight.set_timeout(job["timeout"])
    config = {**config, "job": {**job, "total_steps": total, "steps_per_epoch": per_epoch}}
    strategy = agreed_call(comm, build_strategy, config, comm, meta)
    hook = agreed_call(comm, _checkpoint_hook, config, comm)
    if hook is not None:
        hook.attach(strategy)
        if config["checkpoint"]["resume"]:
            hook.resume(strategy)
    if resilience is not None:           # after a lost rank: the survivors' state, loaded
        resilience.attach(strategy, hook)
    is_root = comm.rank == 0
    if is_root:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.json"), "w") as fh:
            json.dump(config, fh, indent=1, default=str)
        log.info("job %s: %s on %d ranks, model %s, %d train / %d test samples, %d steps",
                 job["name"], config["parallel"]["strategy"], comm.size, config["model"]["name"],
                 train.n, test.n, total)
    writer = MetricsWriter(os.path.join(out_dir, "metrics.jsonl"), is_root, append=strategy.step > 0)
    bar = None

    def progress_bar():
        # on a terminal a live bar; in a batch log (SLURM, CI) a line every 10 s, not
        # thousands. Made after the run's first step, which compiles the kernels, so that its
        # rate and time left come from steady steps
        interactive = sys.stderr.isatty()
        return tqdm(total=total, initial=strategy.step, desc=job["name"], unit="step",
                    dynamic_ncols=interactive, mininterval=0.1 if interactive else 10.0)

    sampler = DistributedSampler(train.n, config["data"]["batch_size"], rank=strategy.data_rank,
                                 size=strategy.data_size, seed=job["seed"], shuffle=config["data"]["shuffle"],
                                 drop_last=config["data"]["drop_last"])
    eval_bs = max(config["data"]["batch_size"], 256)
    last_eval, eval_at = None, None
    samples = 0
    t_train = time.perf_counter()
    while strategy.step < total:
        epoch, skip = divmod(strategy.step, per_epoch)
        sampler.set_epoch(epoch)
        batches = iterate(train, sampler, start=skip)     # skip > 0: resumed mid-epoch
        t0 = time.perf_counter()
        for i, (x, y, count) in enumerate(batches, start=skip):
            t_data = time.perf_counter() - t0
            m = strategy.train_step(x, y, global_count=count)
            t_step = time.perf_counter() - t0
            samples += count
            rec = {"event": "step", "step": strategy.step, "epoch": epoch, "loss": m["loss"],
                   "accuracy": m["correct"] / max(m["count"], 1), "samples": count, "t_step": t_step,
                   "t_data": t_data, "samples_per_s": count / t_step,
                   **{k: m[k] for k in ("t_compute", "t_comm", "t_optim")},
                   **{k: m[k] for k in ("lr", "skipped") if k in m},
                   **{k: v for k, v in m.items() if k.startswith("mem_")}}   # e.g. ZeRO's memory report
            writer.write(rec)
            if resilience is not None:          # before any other collective can fail
                resilience.step_done(rec)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{m['loss']:.4f}", samples_s=f"{count / t_step:.0f}", refresh=False)
            elif is_root and job["progress"]:
                bar = progress_bar()
            last = strategy.step >= total
            if hook is not None:
                hook.after_step(strategy, last)
            if resilience is not None:
                resilience.after_step(strategy, rec)
            ev = job["eval_every"]
            if (ev and strategy.step % ev == 0) or (not ev and (i == per_epoch - 1 or last)):
                last_eval, eval_at = evaluate(strategy, test, eval_bs), strategy.step
                writer.write({"event": "eval", "step": strategy.step, "epoch": epoch, **last_eval})
                if is_root and job["progress"]:
                    tqdm.write(f"[rank 0/{comm.size}] step {strategy.step} epoch {epoch}: test loss "
                               f"{last_eval['loss']:.4f} accuracy {last_eval['accuracy']:.4f}")
            if last:
                break
            t0 = time.perf_counter()
    t_loop = time.perf_counter() - t_train
    if eval_at != strategy.step:
        last_eval = evaluate(strategy, test, eval_bs)
        writer.write({"event": "eval", "step": strategy.step, **last_eval})
    if bar is not None:
        bar.close()
    summary = {"job": job["name"], "ranks": comm.size, "strategy": config["parallel"]["strategy"],
               "steps": strategy.step, "test_loss": last_eval["loss"], "test_accuracy": last_eval["accuracy"],
               "train_seconds": t_loop, "total_seconds": time.perf_counter() - t_start,
               "samples_per_s": samples / t_loop if t_loop > 0 else 0.0,
               "memory": strategy.memory_report()}
    if resilience is not None:
        summary["recoveries"] = resilience.recoveries
    if hook is not None:
        hook.close()
    writer.close()
    if is_root:
        with open(os.path.join(out_dir, "summary.json"), "w") as fh:
            json.dump(summary, fh, indent=1)
        if job["plot"]:
            summary["plot"] = plot_run(os.path.join(out_dir, "metrics.jsonl"), os.path.join(out_dir, "training.png"),
                                       f"{job['name']}: {comm.size} ranks, {config['parallel']['strategy']}")
        log.info("done: %d steps in %.1f s, test accuracy %.4f, %.0f samples/s; metrics and plot in %s",
                 strategy.step, t_loop, last_eval["accuracy"], summary["samples_per_s"], out_dir)
    strategy.close()
    return summary

