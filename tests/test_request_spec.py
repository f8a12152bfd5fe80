"""`RequestSpec` refuses, when it is made, a request no engine can run as written.

The trace loaders check their files' fields (naming file and line); a spec built in code
(the Python API of the engines: `serve`, `replay`, a custom workload) is checked by the
spec itself, each error naming the request and the field. Before, such a spec ran until an
engine reached it (a negative output length surfaced as a `Sequence` "room" error, a beam
schedule naming a beam that does not exist as a strict `zip` error mid-replay) or ran
silently wrong (parallel samples ignored under beam search)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from cachelib.errors import InvalidRequestError
from cachelib.types import ExtraKeys
from experiments.workloads.sampling import generate
from experiments.workloads.spec import RequestSpec

PROMPT = np.arange(8, dtype=np.int32)


def spec(**fields) -> RequestSpec:
    args = dict(request_id="r0", prompt_source=PROMPT, output_len=3)
    args.update(fields)
    return RequestSpec(**args)


def test_a_plain_spec_and_every_plan_of_the_workloads_are_accepted():
    spec()
    spec(output_len=0, arrival=1.5, prefix_id=0, after="r-1", think_time=0, extra=ExtraKeys(cache_salt="s"))
    spec(output_len=np.int64(3), arrival=np.float64(2.0))  # numpy scalars, as generators give
    spec(prompt_source=lambda: PROMPT)  # a lazy prompt is not built
    spec(n=2, sample_lens=(3, 5), forced_output=np.array([4, 5], dtype=np.int64))
    for mode in ("parallel", "beam"):
        for r in generate("sharegpt", mode, 3, 5):
            dataclasses.replace(r.spec)  # (re-validated as the engines' replace does)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"request_id": ""}, "request id"),
        ({"request_id": 7}, "request id"),
        ({"prompt_source": np.zeros((2, 4), dtype=np.int32)}, "1-D"),
        ({"prompt_source": [1, 2, 3]}, "prompt_source"),
        ({"output_len": -1}, "output_len must be >= 0"),
        ({"output_len": 2.0}, "output_len must be an int"),
        ({"output_len": True}, "output_len must be an int"),
        ({"arrival": -0.5}, "arrival"),
        ({"arrival": math.nan}, "arrival"),
        ({"arrival": "0"}, "arrival"),
        ({"extra": None}, "extra"),
        ({"prefix_id": -1}, "prefix_id"),
        ({"n": 0}, "n must be >= 1"),
        ({"beam_width": 0}, "beam_width must be >= 1"),
        ({"n": 2, "beam_width": 2}, "one or the other"),
        ({"after": ""}, "after"),
        ({"think_time": math.inf}, "think_time"),
        ({"n": 3, "sample_lens": (3, 4)}, "sample_lens"),
        ({"n": 2, "sample_lens": (3, -4)}, "sample_lens must be >= 0"),
        ({"beam_parents": np.zeros((3, 1), dtype=np.int32)}, "beam_width is 1"),
        ({"beam_width": 2, "beam_parents": np.zeros((2, 2), dtype=np.int32)}, "shape (output_len, beam_width)"),
        ({"beam_width": 2, "beam_parents": np.zeros((3, 2))}, "integer"),
        ({"beam_width": 2, "beam_parents": np.array([[0, 1], [0, 1], [0, 1]])}, "row 0"),
        ({"beam_width": 2, "beam_parents": np.array([[0, 0], [0, 2], [0, 1]])}, "0..1"),
        ({"forced_output": np.zeros((2, 2), dtype=np.int32)}, "forced_output"),
        ({"forced_output": np.array([1.5])}, "forced_output"),
    ],
)
def test_a_spec_no_engine_can_run_is_refused_naming_the_field(fields, named):
    with pytest.raises(InvalidRequestError, match="r0|request id") as err:
        spec(**fields)
    assert named in str(err.value)


def test_a_beam_schedule_of_the_right_form_is_accepted():
    parents = np.array([[0, 0], [1, 1], [0, 1]], dtype=np.int32)
    assert spec(beam_width=2, beam_parents=parents).beam_parents is parents
    spec(beam_width=2)  # no schedule: replay names it before any work (`Replay.run`)


def test_a_spec_pickles_field_for_field():
    """A workload reaches every cell's process pickled (`RequestSpec.__getstate__`): each
    field comes back, arrays equal, a lazy prompt builds the same tokens."""
    import pickle

    from experiments.workloads.mooncake import MooncakePrompt

    specs = [
        RequestSpec("a", np.arange(5, dtype=np.int32), 3, arrival=1.5, prefix_id=2, after="z", think_time=0.25),
        RequestSpec("b", MooncakePrompt((7, 9), 700), 4, n=2, sample_lens=(4, 1)),
        RequestSpec(
            "c",
            np.arange(3, dtype=np.int32),
            2,
            beam_width=2,
            beam_parents=np.array([[0, 0], [1, 1]]),
            forced_output=np.array([5, 6]),
        ),  # fmt: skip
    ]
    for spec in specs:
        back = pickle.loads(pickle.dumps(spec))
        assert type(back) is RequestSpec
        for f in dataclasses.fields(RequestSpec):
            mine, theirs = getattr(spec, f.name), getattr(back, f.name)
            if isinstance(mine, np.ndarray):
                assert np.array_equal(mine, theirs) and mine.dtype == theirs.dtype
            elif isinstance(mine, MooncakePrompt):
                assert np.array_equal(mine(), theirs()) and len(mine) == len(theirs)
            else:
                assert mine == theirs, f.name
        with pytest.raises(dataclasses.FrozenInstanceError):
            back.output_len = 9  # type: ignore[misc]
