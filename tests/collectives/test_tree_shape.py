"""The binomial tree's top exchange, as data (no MPI): two half-roots that name each other
with rank 0 leading, and undoing the exchange gives back the plain binomial tree."""
import pytest

from mpidist.collectives.tree import _binomial, _reduce_then_broadcast, binomial_tree, top_child


@pytest.mark.parametrize("p", range(2, 18))
def test_top_edge_is_an_exchange_between_two_half_roots(p):
    trees = [_binomial(r, p, 10)[0] for r in range(p)]
    half = top_child(p)
    assert half < p <= 2 * half
    assert [r for r, t in enumerate(trees) if t.parent is None] == [0, half]
    assert (trees[0].peer, trees[0].lead) == (half, True)
    assert (trees[half].peer, trees[half].lead) == (0, False)
    assert all(t.peer is None for r, t in enumerate(trees) if r not in (0, half))
    for r, t in enumerate(trees):
        plain = _reduce_then_broadcast(t)
        assert (plain.parent, plain.children, plain.peer) == (*binomial_tree(r, p), None)
