"""mpidist.mpilib: which MPI library this process runs in, as everything MPI-specific asks."""
import os

from mpi4py import MPI

from mpidist import mpilib


def test_the_family_version_and_file_are_those_of_the_library_mpi4py_loaded():
    text = MPI.Get_library_version()
    fam = mpilib.family()
    assert fam in ("openmpi", "mpich", "intel", "mvapich", "cray", "other")
    assert (fam == "openmpi") == ("Open MPI" in text)
    assert mpilib.version() in text.replace("\x00", "")
    path = mpilib.path()
    assert path and os.path.exists(path) and "mpi" in os.path.basename(path).lower()
    assert mpilib.abi() in ("native", "mpich", "openmpi", "MPI-5 standard")
    assert mpilib.version() in mpilib.describe()


def test_ulfm_switch_is_read_from_the_library_s_own_variable():
    var = "OMPI_MCA_mpi_ft_enable" if mpilib.family() == "openmpi" else "MPIR_CVAR_ENABLE_FT"
    assert mpilib.ulfm_switched_on({var: "1"}) is True
    assert mpilib.ulfm_switched_on({var: "0"}) is False
    other = "MPIR_CVAR_ENABLE_FT" if var.startswith("OMPI") else "OMPI_MCA_mpi_ft_enable"
    assert mpilib.ulfm_switched_on({other: "1"}) is False     # another library's switch


def test_osc_ucx_is_left_out_only_without_an_rdma_device(monkeypatch, tmp_path):
    from mpidist import mpienv
    mine = {"OMPI_MCA_btl_tcp_eager_limit": "1", "UCX_RNDV_THRESH": "auto"}
    monkeypatch.setattr(mpienv, "_RDMA", str(tmp_path / "none"))
    assert mpienv.apply(dict(mine)) == {"OMPI_MCA_osc": "^ucx"}
    assert mpienv.apply({"OMPI_MCA_osc": "ucx", **mine}) == {}   # the user's setting stands
    (tmp_path / "ib").mkdir()
    (tmp_path / "ib" / "mlx5_0").mkdir()
    monkeypatch.setattr(mpienv, "_RDMA", str(tmp_path / "ib"))
    assert mpienv.apply(dict(mine)) == {}


def _rdma(monkeypatch, tmp_path, present):
    from mpidist import mpienv
    if present:
        (tmp_path / "ib" / "mlx5_0").mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(mpienv, "_RDMA", str(tmp_path / ("ib" if present else "none")))


def test_tcp_eager_limit_holds_one_ring_segment_unless_set(monkeypatch, tmp_path):
    from mpidist import mpienv
    _rdma(monkeypatch, tmp_path, True)          # UCX's threshold: the next test
    var = "OMPI_MCA_btl_tcp_eager_limit"
    base = {"OMPI_MCA_osc": "ucx"}
    assert mpienv.apply(dict(base))[var] == str((1 << 20) + 1024)
    env = {**base, "MPIDIST_SEGMENT_BYTES": str(4 << 20)}
    assert mpienv.apply(env) == {var: str((4 << 20) + 1024)} and env[var] == str((4 << 20) + 1024)
    assert mpienv.apply({**base, var: "65536"}) == {}             # the user's setting stands
    assert mpienv.apply({**base, "MPIDIST_SEGMENT_BYTES": "4096"}) == {}  # never below Open MPI's
    assert mpienv.apply({**base, "MPIDIST_SEGMENT_BYTES": "lots"}) == {}  # the ring raises later
    # above EAGER_MOST the segments stay with rendezvous: no pool of huge eager buffers
    most = mpienv.EAGER_MOST
    assert mpienv.apply({**base, "MPIDIST_SEGMENT_BYTES": str(most)}) == {var: str(most + 1024)}
    assert mpienv.apply({**base, "MPIDIST_SEGMENT_BYTES": str(most + 1)}) == {}


def test_ucx_rendezvous_threshold_holds_one_segment_only_where_ucx_runs_on_tcp(monkeypatch,
                                                                                tmp_path):
    """No RDMA device: UCX's traffic between nodes is TCP, its rendezvous answer queues behind
    the data like Open MPI's, and the threshold holds a segment; with one, UCX's zero-copy
    rendezvous stays."""
    from mpidist import mpienv
    var, seg = "UCX_RNDV_THRESH", str((1 << 20) + 1024)
    base = {"OMPI_MCA_osc": "ucx", "OMPI_MCA_btl_tcp_eager_limit": "65536"}
    _rdma(monkeypatch, tmp_path, False)
    assert mpienv.apply(dict(base)) == {var: seg}
    assert mpienv.apply({**base, var: "8kb"}) == {}                 # the user's setting stands
    assert mpienv.apply({**base, "MPIDIST_SEGMENT_BYTES": str(mpienv.EAGER_MOST + 1)}) == {}
    _rdma(monkeypatch, tmp_path, True)
    assert mpienv.apply(dict(base)) == {}
