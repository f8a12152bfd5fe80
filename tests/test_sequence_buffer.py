"""A `Sequence`'s token buffer on the decode path: runs of fresh ids validated at their ends,
room reserved for the output, and how much an engine reserves."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.mark.parametrize("bad", [[1, 2.0], [True], [-1], [2**31]])
def test_extend_ids_refuses_what_append_refuses(bad):
    """The decode-path append validates as `append` does, and a refused call changes nothing."""
    from cachelib.errors import InvalidRequestError
    from cachelib.types import Sequence

    s = Sequence("r", np.arange(4, dtype=np.int32))
    with pytest.raises(InvalidRequestError, match="token id"):
        s.extend_ids(bad)
    assert len(s) == 4
    s.extend_ids([7, 8])
    assert s.tokens.tolist() == [0, 1, 2, 3, 7, 8]


@pytest.mark.parametrize("bad", [range(-1, 2), range(2**31 - 1, 2**31 + 1), range(5, 9, 2)])
def test_extend_ids_refuses_a_bad_run(bad):
    """A run of fresh ids (a `range`) is validated at its ends and must step by 1; a refused
    run changes nothing, an accepted one appends exactly the list it stands for."""
    from cachelib.errors import InvalidRequestError
    from cachelib.types import Sequence

    s = Sequence("r", np.arange(4, dtype=np.int32))
    with pytest.raises(InvalidRequestError, match="token id|step by 1"):
        s.extend_ids(bad)
    assert len(s) == 4
    s.extend_ids(range(2**31 - 3, 2**31))  # the largest ids fit
    s.extend_ids(range(9, 9))  # an empty run is a no-op
    s.extend_ids(range(100, 105))  # past the buffer: it grows
    assert s.tokens.tolist() == [0, 1, 2, 3, 2**31 - 3, 2**31 - 2, 2**31 - 1, 100, 101, 102, 103, 104]


def test_sequence_room_keeps_appends_in_one_buffer():
    """`room` reserves slots past the prompt: appends up to it write into the buffer the
    prompt was copied into (no regrowth), appends past it still grow it, the tokens read
    the same as without room, and the caller's prompt is never the buffer."""
    from cachelib.types import Sequence

    prompt = np.arange(5, dtype=np.int32)
    s, plain = Sequence("r", prompt, room=4), Sequence("p", prompt)
    buf = s._buf
    assert buf is not prompt and buf.size == 9
    for seq in (s, plain):
        seq.extend_ids(range(100, 103))
        seq.append_token(7)
    assert s._buf is buf  # four appended tokens: inside the room
    s.extend_ids([8, 9])  # past it: the buffer grows
    plain.extend_ids([8, 9])
    assert s.tokens.tolist() == plain.tokens.tolist() == [0, 1, 2, 3, 4, 100, 101, 102, 7, 8, 9]
    assert prompt.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("bad", [-1, 2.0, True, None])
def test_sequence_room_must_be_a_non_negative_int(bad):
    from cachelib.errors import InvalidRequestError
    from cachelib.types import Sequence

    with pytest.raises(
        InvalidRequestError, match=r"room \(token slots reserved for its output\) must be a non-negative int"
    ):
        Sequence("r", np.arange(3, dtype=np.int32), room=bad)


def test_output_room_is_the_output_length_up_to_a_cap():
    """Engines reserve a request's output length, but never more than `MAX_OUTPUT_ROOM`
    slots up front (a trace may declare outputs far longer than a run generates)."""
    from experiments.engine.request import MAX_OUTPUT_ROOM, output_room
    from experiments.workloads.spec import RequestSpec

    prompt = np.arange(3, dtype=np.int32)
    assert output_room(RequestSpec("a", prompt, 0)) == 0
    assert output_room(RequestSpec("a", prompt, 37)) == 37
    assert output_room(RequestSpec("a", prompt, 147_483_647)) == MAX_OUTPUT_ROOM
