"""Inside the MPI job: each compressor's bytes on the job's own layout, then one
training run per compressor; rank 0 prints the result for the driver."""
from __future__ import annotations

import json
import os

import numpy as np

from experiments import common
from experiments.compression.compressors import COMPRESSORS


def bytes_per_step(comm, config_path: str, overrides: dict, compressors) -> dict:
    """Per compressor: bytes the busiest rank sends in one allreduce of the job's gradient."""
    from mpidist.compress import CompressedAllreduce, make_compressor
    from mpidist.compress.ring import ring_allreduce_bytes
    from mpidist.data.loader import build_datasets
    from mpidist.engine.config import load_config
    from mpidist.strategy.builders import build_model_from_config
    from mpidist.flat import Layout
    cfg = load_config(config_path, comm, overrides)
    train, test, meta = build_datasets(cfg, comm)
    train.close()
    test.close()
    layout = Layout(build_model_from_config(cfg, meta).param_shapes())
    g = np.random.default_rng(comm.rank).standard_normal(layout.numel).astype(np.float32)
    out = {}
    for label, name, opts in compressors:
        if name == "none":
            sent = ring_allreduce_bytes(layout.numel, comm.size, comm.rank)
        else:
            ca = CompressedAllreduce(make_compressor(name, **opts), comm)
            ca(g.copy(), layout)
            sent = ca.bytes_sent
        out[label] = max(comm.comm.allgather(int(sent)))
    return {"bytes": out, "numel": layout.numel}


def main(spec_path: str) -> int:
    """Inside the MPI job: bytes per compressor, then one training run per compressor."""
    from mpidist.comm import Communicator
    from mpidist.engine.config import load_config
    from mpidist.engine.loop import run
    with open(spec_path) as fh:
        spec = json.load(fh)
    comm = Communicator()
    config_path, base, out_dir = spec["config"], spec["overrides"], spec["out"]
    compressors = [c for c in COMPRESSORS if c[0] in spec["compressors"]]
    result = bytes_per_step(comm, config_path, base, compressors)
    result["runs"] = {}
    for label, name, opts in compressors:
        sub = os.path.join(out_dir, str(len(result["runs"])))
        over = {**base, "job.out_dir": sub, "parallel.compression": name}
        if opts:
            over["parallel.compression_options"] = opts
        summary = run(load_config(config_path, comm, over), comm)
        result["runs"][label] = {"out": sub, "steps": summary["steps"],
                                 "test_accuracy": summary["test_accuracy"],
                                 "test_loss": summary["test_loss"],
                                 "train_s": summary["train_seconds"]}
    if comm.rank == 0:
        common.emit(result)
    comm.free()
    return 0
