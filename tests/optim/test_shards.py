"""Layer-wise trust ratios from split shards equal the unsplit ones.

Every rank owns chunk(numel, rank, size) of the flat buffer, cut again into `pieces` local
ranges, so tensors straddle both the rank cuts and the local cuts. Per-segment partial sums
are added over the local pieces and allreduced over MPI; the result is what each piece's
reduce_norms returns. The unsplit optimizer (whole buffer, no reduction) runs on every rank
from the same seed and must agree on trust ratios and weights."""
import numpy as np
import pytest
from mpi4py import MPI

from mpidist.flat import Layout
from mpidist.optim import build_optimizer
from mpidist.partition import chunk

LAYOUT = Layout([("a.weight", (13, 11)), ("a.bias", (11,)), ("b.weight", (7, 29)),
                 ("norm.weight", (29,)), ("c.weight", (29, 3)), ("c.bias", (3,))])


@pytest.mark.parametrize("pieces", [1, 2, 3])
@pytest.mark.parametrize("name,hyper", [
    ("lars", {"lr": 0.5, "weight_decay": 1e-3}),
    ("lamb", {"weight_decay": 0.01}),
    ("lamb", {"amsgrad": True, "phi_clamp": (0.0, 2.0), "exclude": ()}),
])
def test_split_trust_ratios_equal_unsplit(comm, name, hyper, pieces):
    rank, size = comm.rank, comm.size
    off, cnt = chunk(LAYOUT.numel, rank, size)
    ranges = [(off + o, c) for o, c in (chunk(cnt, k, pieces) for k in range(pieces))]
    shards = [build_optimizer(name, LAYOUT, offset=o, count=c, **hyper) for o, c in ranges]
    whole = build_optimizer(name, LAYOUT, **hyper)
    rng = np.random.default_rng(42)                       # same stream on every rank
    full = rng.standard_normal(LAYOUT.numel).astype(np.float32)
    mine = full.copy()
    for _ in range(5):
        g = rng.standard_normal(LAYOUT.numel).astype(np.float32)
        want = whole.step(full, g).trust_ratios
        partial = sum(s.partial_sums(mine[o:o + c], g[o:o + c])
                      for s, (o, c) in zip(shards, ranges))
        total = np.empty_like(partial)
        comm.comm.Allreduce(partial, total, op=MPI.SUM)
        for s, (o, c) in zip(shards, ranges):
            got = s.step(mine[o:o + c], g[o:o + c], reduce_norms=lambda _: total).trust_ratios
            np.testing.assert_allclose(got, want, rtol=1e-10)
    np.testing.assert_allclose(mine[off:off + cnt], full[off:off + cnt], rtol=1e-6)


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_allreduce_as_reduce_norms_agrees_on_skips(comm, name):
    """One rank's NaN gradient skips the step on every rank (the reduced ||g||^2 is NaN)."""
    off, cnt = chunk(LAYOUT.numel, comm.rank, comm.size)
    opt = build_optimizer(name, LAYOUT, offset=off, count=cnt)

    def allreduce(partial):
        out = np.empty_like(partial)
        comm.comm.Allreduce(partial, out, op=MPI.SUM)
        return out

    p = np.ones(cnt, np.float32)
    g = np.full(cnt, 0.5, np.float32)
    if comm.rank == comm.size - 1 and cnt:
        g[-1] = np.nan
    info = opt.step(p, g, reduce_norms=allreduce)
    assert info.skipped and np.all(p == 1.0) and opt.step_count == 0
    g[...] = 0.5
    assert not opt.step(p, g, reduce_norms=allreduce).skipped
