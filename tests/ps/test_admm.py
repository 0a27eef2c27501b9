"""Consensus ADMM reaches the single-process optimum (scikit-learn's) at any rank count."""
import numpy as np
import pytest
from sklearn.linear_model import Lasso as SkLasso
from sklearn.linear_model import LogisticRegression as SkLogistic

from mpidist.admm import Lasso, LogisticRegression, consensus_admm, soft_threshold
from mpidist.partition import chunk


def _my_rows(comm, *arrays):
    off, cnt = chunk(len(arrays[0]), comm.rank, comm.size)
    return [a[off:off + cnt] for a in arrays]


def test_soft_threshold():
    np.testing.assert_array_equal(soft_threshold(np.array([-3.0, -0.5, 0.0, 0.2, 2.0]), 1.0),
                                  [-2.0, 0.0, 0.0, 0.0, 1.0])


def test_lasso_matches_single_process_solver(comm):
    rng = np.random.default_rng(1)
    m, n, lam = 120, 12, 4.0
    A = rng.normal(size=(m, n))
    truth = np.where(rng.random(n) < 0.4, rng.normal(size=n) * 2, 0.0)
    b = A @ truth + 0.1 * rng.normal(size=m)
    res = consensus_admm(Lasso(*_my_rows(comm, A, b), lam), comm=comm, rho=1.0)
    ref = SkLasso(alpha=lam / m, fit_intercept=False, tol=1e-12, max_iter=100000).fit(A, b).coef_
    assert res.converged
    np.testing.assert_allclose(res.z, ref, atol=1e-4)
    assert (res.z == 0).any() and (res.z != 0).any()       # a sparse, non-trivial optimum


def test_logistic_regression_matches_single_process_solver(comm):
    rng = np.random.default_rng(2)
    m, n, lam = 160, 6, 0.5
    A = rng.normal(size=(m, n))
    y = np.where(A @ rng.normal(size=n) + 0.5 * rng.normal(size=m) > 0, 1.0, -1.0)
    res = consensus_admm(LogisticRegression(*_my_rows(comm, A, y), lam), comm=comm, rho=1.0)
    ref = SkLogistic(C=1.0 / lam, fit_intercept=False, tol=1e-12, max_iter=10000).fit(A, y).coef_[0]
    assert res.converged
    np.testing.assert_allclose(res.z, ref, atol=1e-4)


def test_rho_adapts_and_residuals_shrink(comm):
    rng = np.random.default_rng(3)
    A = rng.normal(size=(80, 5))
    b = A @ np.ones(5)
    res = consensus_admm(Lasso(*_my_rows(comm, A, b), 0.1), comm=comm, rho=1e3)
    rhos = [h[4] for h in res.history]
    assert res.converged and min(rhos) < 1e3                 # started far too large: lowered
    assert res.history[-1][0] < res.history[0][0]


def test_admm_checks_arguments(comm):
    with pytest.raises(ValueError):
        Lasso(np.zeros((3, 2)), np.zeros(4), 1.0)
    with pytest.raises(ValueError):
        LogisticRegression(np.zeros((3, 2)), np.array([0.0, 2.0, 1.0]), 1.0)
    with pytest.raises(ValueError):
        consensus_admm(Lasso(np.ones((2, 2)), np.ones(2), 1.0), comm=comm, rho=0.0)
