"""bench.steadiness: the reference copy is timed on every rank at once and every rank
reports the same figures (the slowest rank's), at any rank count."""
from mpidist.bench.steadiness import Steadiness


def test_samples_agree_across_ranks(comm):
    steady = Steadiness(comm.comm, nbytes=1 << 20)
    assert steady.line() == "machine steadiness: not sampled"
    for _ in range(3):
        steady.sample()
    d = steady.summary()
    assert d["reference_bytes"] == 1 << 20 and len(d["samples_s"]) == 3
    assert 0 < d["min_s"] <= d["median_s"] <= d["max_s"] and d["max_over_min"] >= 1
    assert comm.comm.allgather(d["samples_s"]) == [d["samples_s"]] * comm.size
    assert "1 MiB copy on every rank" in steady.line()
    states = d["state_samples_s"]                   # the machine state, where ranks exchange
    assert len(states) == (3 if comm.size > 1 else 0) and all(t > 0 for t in states)
    assert comm.comm.allgather(states) == [states] * comm.size
    assert ("KiB MPI_Allreduce" in steady.line()) == (comm.size > 1)
