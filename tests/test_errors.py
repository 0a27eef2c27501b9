"""agree_or_raise: one rank's failure raised on every rank, each told who failed and why."""
import pytest

from mpidist.errors import RemoteError, agree_or_raise, format_failures, format_ranks


def test_formatting_groups_ranks_with_the_same_error():
    assert format_ranks([0, 1, 2, 5]) == "0-2,5"
    text = format_failures([(0, "ValueError", "bad"), (1, "ValueError", "bad"), (3, "OSError", "gone")])
    assert text == "failed on rank(s) 0-1: ValueError: bad; rank(s) 3: OSError: gone"


def test_agree_or_raise_raises_everywhere(comm):
    agree_or_raise(comm, None)
    last = comm.size - 1
    err = KeyError("shard 7") if comm.rank == last else None
    with pytest.raises(KeyError if comm.rank == last else RemoteError) as info:
        agree_or_raise(comm, err)
    assert info.value.failures == [(last, "KeyError", "'shard 7'")]
    if comm.rank != last:
        assert f"rank(s) {last}: KeyError" in str(info.value)


def test_the_other_ranks_raise_the_class_the_caller_catches(comm):
    class StoreError(RuntimeError):
        pass

    err = StoreError("disk full") if comm.rank == 0 else None
    with pytest.raises(StoreError, match="disk full"):
        agree_or_raise(comm, err, StoreError)
