"""`mpidist bench torch` and `bench torch_backend`: end to end at a tiny size on 2 ranks, and
their invariants (figures not checked: benchmarks print, tests assert behaviour): every
variant trained the same model to the same parameters, and a run where they differ fails."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="mpidist bench torch needs PyTorch (the [torch] extra)")

from mpidist.launcher import without_job_variables      # noqa: E402


@pytest.mark.launcher
@pytest.mark.timeout(400)
def test_bench_torch_gpt_reports_every_variant(tmp_path):
    out = tmp_path / "bench"
    argv = [sys.executable, "-m", "mpidist", "bench", "torch", "--model", "gpt", "--ranks", "2",
            "--steps", "1", "--warmup", "0", "--batch", "2", "--out", str(out)]
    # a fresh job: none of this process's own MPI job variables (mpiexec -n 1 pytest)
    proc = subprocess.run(argv, env=without_job_variables(os.environ), timeout=360,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "GPT (4 layers, dim 256" in proc.stdout
    (row,) = json.loads((out / "torch.json").read_text())["rows"]
    from mpidist.torch.models import GPT
    assert row["ranks"] == 2 and row["params"] == sum(p.numel() for p in GPT().parameters())
    for variant in ("torch", "ddp", "mpidist", "mpidist-fused", "zero2"):
        assert row[variant]["samples_per_s"] > 0
    # the data-parallel variants (not plain torch, on one rank's batch) reached one model
    assert set(row["agree"]["variants"]) == {"ddp", "mpidist", "mpidist-fused", "zero2"}
    assert row["agree"]["max_rel_diff"] <= 1e-5, row["agree"]
    assert list(row["agree"]["pair"]) == ["ddp", "mpidist"]
    assert row["agree"]["own_kernel"]["max_rel_diff"] <= 1e-4, row["agree"]
    assert row["build_orders"] == ["forward", "reverse"]     # one job each, rounds pooled
    assert all(len(v) == 2 for v in row["raw"].values())
    # when each mpidist bucket's gradients were final, per timed step: in bucket order, within
    # the step, the buckets covering every gradient once
    for variant in ("mpidist", "mpidist-fused", "zero2"):
        ready = row["ready"][variant]
        assert sum(ready["bytes"]) == 4 * row["params"] and len(ready["at"]) == 2
        for at in ready["at"]:
            assert len(at) == len(ready["bytes"]) and at == sorted(at) and 0 < at[0] < 60


@pytest.mark.launcher
@pytest.mark.timeout(400)
def test_bench_torch_backend_checks_both_backends_agree(tmp_path):
    out = tmp_path / "bench"
    argv = [sys.executable, "-m", "mpidist", "bench", "torch_backend", "--ranks", "2",
            "--steps", "2", "--warmup", "1", "--batch", "4", "--out", str(out)]
    proc = subprocess.run(argv, env=without_job_variables(os.environ), timeout=360,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = json.loads((out / "torch_backend.json").read_text())["rows"]
    assert row["agree"] <= 1e-6 and "largest relative difference" in proc.stdout
    # one job per build order, their steps pooled
    assert row["build_orders"] == ["forward", "reverse"]
    assert len(row["gloo"]["times"]) == len(row["mpidist"]["times"]) == 2 * 2
    # plain torch, the compute bound, takes its turns too
    assert len(row["torch"]["times"]) == 2 * 2 and "compute%" in proc.stdout


def test_bench_torch_backend_reports_the_compute_and_link_bounds():
    import argparse
    from mpidist.bench.torch_backend import _report
    row = {"ranks": 2, "nodes": 2, "batch_per_rank": 32, "params": 1_000_000, "agree": 0.0,
           "torch": {"step": 0.01, "samples_per_s": 6400.0},
           "gloo": {"step": 0.1, "samples_per_s": 640.0},
           "mpidist": {"step": 0.08, "samples_per_s": 800.0}}
    args = argparse.Namespace(batch=32, bucket_mb=25.0, bucket_view=True, steps=3, algorithm="auto",
                              cluster="2x1", bandwidth="1gbit")
    out = _report([row], args).splitlines()
    mine = next(x.split() for x in out if x.split()[:2] == ["2", "mpidist"])
    assert mine[4:] == ["1.25x", "12%", "40%"]     # 800/640; of 6400/s; of 2000/s (4 MB at 1 Gbit/s)
    line = next(x for x in out if "link bound" in x)
    payload = 64 / (4e6 * 8 / (1e9 * 1448 / 1514))
    assert f"{payload:.0f} samples/s: gloo {100 * 640 / payload:.0f}%, mpidist {100 * 800 / payload:.0f}%" in line
    # on one host: no link bound, the compute share still
    one = _report([{**row, "nodes": 1}], argparse.Namespace(**{**vars(args), "cluster": None}))
    assert "link bound" not in one and "12%" in one


def test_build_orders_are_pooled_and_the_worst_agreement_kept():
    from mpidist.bench._driver import in_build_order
    from mpidist.bench.torch_backend import merge
    assert in_build_order("ab", type("A", (), {"build_order": "reverse"})) == ["b", "a"]
    assert in_build_order("ab", type("A", (), {"build_order": "forward"})) == ["a", "b"]
    rows = [{"ranks": 2, "batch_per_rank": 4, "agree": a, "build_orders": [o],
             "gloo": {"times": g}, "mpidist": {"times": m}}
            for a, o, g, m in ((0.0, "forward", [1.0, 3.0], [2.0, 2.0]),
                               (1e-9, "reverse", [2.0, 8.0], [1.0, 1.0]))]
    row = merge(rows)
    assert row["gloo"]["step"] == 2.5 and row["gloo"]["samples_per_s"] == 8 / 2.5
    assert row["mpidist"]["step"] == 1.5 and row["agree"] == 1e-9
    assert row["build_orders"] == ["forward", "reverse"]


@pytest.mark.launcher
@pytest.mark.timeout(400)
def test_bench_torch_tta_follows_ddp_uncompressed(tmp_path):
    out = tmp_path / "bench"
    argv = [sys.executable, "-m", "mpidist", "bench", "torch_tta", "--ranks", "2", "--steps", "4",
            "--eval-every", "2", "--batch", "2", "--freeze-step", "2", "--out", str(out)]
    proc = subprocess.run(argv, env=without_job_variables(os.environ), timeout=360,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = json.loads((out / "torch_tta.json").read_text())["rows"]
    curves = row["curves"]
    assert set(curves) == {"ddp", "mpidist", "powersgd", "onebit"}
    assert all([p[0] for p in c] == [2, 4] for c in curves.values())
    for (_, _, l_ddp), (_, _, l_ours) in zip(curves["ddp"], curves["mpidist"]):
        assert abs(l_ddp - l_ours) <= 1e-4 * l_ddp
    assert all(c[0][1] == 0.0 < c[1][1] for c in curves.values())   # 2 warm-up steps uncounted


def test_time_to_a_loss_and_a_run_that_leaves_ddp_fails():
    from mpidist.bench.torch_tta import check, time_to
    curve = [(10, 1.0, 3.0), (20, 2.0, 2.5), (30, 3.0, 2.6)]
    assert time_to(curve, 2.55) == (20, 2.0) and time_to(curve, 2.0) is None
    row = {"ranks": 2, "curves": {"ddp": curve, "mpidist": curve}}
    assert check([row]) is None
    row["curves"]["mpidist"] = [(10, 1.0, 3.0), (20, 2.0, 2.4), (30, 3.0, 2.6)]
    assert "from DDP's" in check([row])


def test_a_bench_whose_variants_differ_fails():
    from mpidist.bench import torch as bench_torch
    from mpidist.bench import torch_backend
    same = {"ranks": 2, "agree": {"max_rel_diff": 3e-7, "pair": ("ddp", "mpidist"),
                                  "variants": ["ddp", "mpidist"]}}
    apart = {"ranks": 4, "agree": {"max_rel_diff": 2e-3, "pair": ("ddp", "mpidist"),
                                   "variants": ["ddp", "mpidist"]}}
    assert bench_torch.check([same]) is None
    assert "4 ranks: 2.0e-03 (ddp vs mpidist)" in bench_torch.check([same, apart])
    nan = {"ranks": 2, "agree": {"max_rel_diff": float("nan"), "pair": ("ddp", "mpidist"),
                                 "variants": ["ddp", "mpidist"]}}
    assert bench_torch.check([nan]) is not None              # NaN parameters never pass
    # pairs with mpidist's own kernel: 1e-4 (its rounding may flip a ReLU), not looser
    own = {"ranks": 8, "agree": {**same["agree"], "own_kernel": {
        "max_rel_diff": 1.4e-5, "pair": ("ddp", "mpidist-fused")}}}
    assert bench_torch.check([own]) is None
    own["agree"]["own_kernel"]["max_rel_diff"] = 3e-4
    assert "8 ranks: 3.0e-04 (ddp vs mpidist-fused)" in bench_torch.check([own])
    assert torch_backend.check([{"ranks": 2, "agree": 0.0}]) is None
    assert torch_backend.check([{"ranks": 2, "agree": 1e-3}]) is not None


def test_bench_torch_pools_the_rounds_of_both_build_orders():
    from mpidist.bench.torch import merge
    agree = [{"max_rel_diff": d, "pair": ("ddp", "mpidist"), "variants": ["ddp", "mpidist"]}
             for d in (1e-7, float("nan"))]
    rows = [{"ranks": 2, "batch_per_rank": 10, "build_orders": [o], "agree": a,
             "raw": {"torch": [[1.0, 0.5, 0.0, 0.1]], "ddp": [[s, 0.5 + s / 2, 0.0, 0.1]]}}
            for o, a, s in (("forward", agree[0], 2.0), ("reverse", agree[1], 4.0))]
    row = merge(rows)
    assert row["build_orders"] == ["forward", "reverse"] and len(row["raw"]["ddp"]) == 2
    assert row["ddp"]["step"] == 3.0 and row["ddp"]["samples_per_s"] == 20 / 3.0
    assert row["ddp"]["comm"] == 1.5                # its forward+backward over plain torch's
    assert row["agree"] is agree[1]                 # a NaN is the worst: the check fails


def test_the_link_bound_is_bytes_per_step_over_the_bandwidth():
    from mpidist.bench._bounds import link_bound
    sent, rate = link_bound(params=1_000_000, ranks=2, nodes=2, batch=100, bits_per_s=1e9)
    assert sent == 4_000_000                        # 2 (n-1)/n of the fp32 gradients, n = 2
    assert rate == pytest.approx(200 / (4e6 * 8 / 1e9))
    assert link_bound(1_000_000, 4, 1, 100, 1e9) is None   # one node: no link to bound it


def test_the_overlap_bound_is_the_latest_bucket_plus_the_bytes_after_it():
    from mpidist.bench._bounds import overlap_bound
    ready = {"bytes": [16e6, 8e6], "at": [[0.040, 0.050], [0.042, 0.060], [0.044, 0.052]]}
    # at 10 Gbit/s between 2 nodes the ring sends each byte once: 24 MB take 19.2 ms, 8 MB 6.4
    step, bucket = overlap_bound(ready, nodes=2, bits_per_s=1e10)
    ends = [max(0.040 + 0.0192, 0.050 + 0.0064), max(0.042 + 0.0192, 0.060 + 0.0064),
            max(0.044 + 0.0192, 0.052 + 0.0064)]
    assert step == pytest.approx(sorted(ends)[1])
    assert bucket == 0                              # two steps of three: the first bucket
    # 4 nodes: 2 (n-1)/n = 1.5 times the bytes cross each link
    assert overlap_bound(ready, 4, 1e10)[0] == pytest.approx(0.042 + 1.5 * 0.0192)  # median
    assert overlap_bound(ready, 1, 1e10) is None    # one node: no link
    assert overlap_bound(ready, 2, None) is None
    assert overlap_bound({"bytes": [1.0], "at": []}, 2, 1e10) is None


def test_the_bounds_at_the_tcp_payload_rate():
    """TCP/IP headers leave 1448 of every 1514 bytes a shaped link carries to payload; the
    report gives both bounds at that rate and each variant's share of the tighter one."""
    import argparse
    from mpidist.bench.torch import _report
    from mpidist.bench._bounds import tcp_payload_share
    assert tcp_payload_share(1500) == pytest.approx(1448 / 1514)
    assert tcp_payload_share(9000) == pytest.approx(8948 / 9014)      # jumbo frames
    timing = {"step": 0.25, "compute": 0.05, "comm": 0.2, "optim": 0.0}
    row = {"ranks": 2, "nodes": 2, "batch_per_rank": 100, "params": 1_000_000,
           "torch": {**timing, "step": 0.05, "samples_per_s": 4000.0},
           "ddp": {**timing, "samples_per_s": 800.0}, "mpidist": {**timing, "samples_per_s": 760.0},
           "ready": {"mpidist": {"bytes": [4e6], "at": [[0.040], [0.040], [0.040]]}},
           "agree": {"variants": ["ddp", "mpidist"], "max_rel_diff": 0.0, "pair": ["ddp", "mpidist"]}}
    args = argparse.Namespace(model="mlp", cluster="2x1", bandwidth="1gbit", batch=100, threads="1",
                              bucket_mb=4.0, steps=3)
    line = next(x for x in _report([row], args).splitlines() if "TCP payload" in x)
    # 4 MB per rank at 1 Gbit/s x 1448/1514: 33.46 ms; after 40 ms of compute the overlap
    # bound, 73.46 ms per step (2722 samples/s), is the tighter one
    payload = 1e9 * 1448 / 1514
    over = 0.040 + 4e6 * 8 / payload
    assert f"link bound {200 / (4e6 * 8 / payload):.0f} samples/s" in line
    assert f"overlap bound {over * 1e3:.1f} ms per step" in line
    assert f"ddp {100 * 800 * over / 200:.0f}%" in line and f"mpidist {100 * 760 * over / 200:.0f}%" in line
