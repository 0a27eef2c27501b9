"""Streaming DiLoCo's schedule as pure data, no MPI: fragments of whole tensors of about
equal size, staggered first steps, and the round starts the strategies resume from."""
import pytest

from mpidist.diloco.streaming import first_syncs, format_schedule, fragment_spans, fragments_due, round_starts
from mpidist.flat import Layout

LAYOUT = Layout([("w1", (8, 4)), ("b1", (4,)), ("w2", (4, 8)), ("b2", (8,))])


def test_fragments_are_runs_of_whole_tensors_of_about_equal_size():
    assert fragment_spans(LAYOUT, 1) == [(0, 76)]
    assert fragment_spans(LAYOUT, 2) == [(0, 36), (36, 76)]
    assert fragment_spans(LAYOUT, 4) == [(0, 32), (32, 36), (36, 68), (68, 76)]
    for f in range(1, 5):
        spans = fragment_spans(LAYOUT, f)
        starts = {s.offset for s in LAYOUT.segments}
        assert spans[0][0] == 0 and spans[-1][1] == LAYOUT.numel and all(lo < hi for lo, hi in spans)
        assert all(a[1] == b[0] and b[0] in starts for a, b in zip(spans, spans[1:]))
    with pytest.raises(ValueError, match=r"fragments must be an int in \[1, 4\]"):
        fragment_spans(LAYOUT, 5)


def test_each_fragment_steps_every_h_from_its_own_offset():
    assert first_syncs(4, 1) == [4] and first_syncs(6, 3) == [6, 2, 4]
    with pytest.raises(ValueError, match="3 fragments need sync_every >= 3"):
        first_syncs(2, 3)
    H, F, total = 6, 3, 20
    starts, seen = round_starts(0, H, F), {f: [] for f in range(F)}
    for t in range(1, total + 1):
        for f in fragments_due(t, starts, H, total):
            seen[f].append(t)
            starts[f] = t
        assert starts == round_starts(t, H, F) or t == total      # the schedule alone says it
    assert seen == {0: [6, 12, 18, 20], 1: [2, 8, 14, 20], 2: [4, 10, 16, 20]}
    assert format_schedule(4, 2, 8).splitlines()[1:] == ["fragment 0 . . . X . . . X",
                                                         "fragment 1 . X . . . X . X"]
