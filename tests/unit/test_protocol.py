"""Messages round-trip through the wire codec; numpy arrays travel as extra frames."""

import msgspec
import numpy as np
import pytest

from vllm_actors.errors import (ModelNotFoundError, ValidationError, VllmActorsError,
                                error_from_wire)
from vllm_actors.protocol.engine import (AbortRequests, CoreMessage, EngineCoreOutput,
                                         EngineCoreOutputs, EngineCoreRequest, EngineDead,
                                         EngineReady, EngineStartupError, FinishReason,
                                         FrontendMessage, SchedulerStats, Shutdown, UtilityCall,
                                         UtilityKind, UtilityResult)
from vllm_actors.protocol.step import StepInput, StepOutput
from vllm_actors.protocol.wire import INLINE_ARRAY_BYTES, Decoder, Encoder, IpcAddresses
from vllm_actors.sampling_params import SamplingParams

FRONTEND = [EngineCoreRequest("r", [1, 2, 3], SamplingParams(stop=["x"], n=2), [2], 1.5, 3, "s"),
            AbortRequests(["a", "b"]), UtilityCall(7, UtilityKind.RESET_PREFIX_CACHE), Shutdown()]
CORE = [EngineReady(10, 16, 8192, 49152),
        EngineCoreOutputs([EngineCoreOutput("r", [5], FinishReason.ERROR, None, 3, "bad")], 2.0,
                          SchedulerStats(1, 2, 0.25, 10, 8, 1)),
        UtilityResult(7, True), UtilityResult(8, SchedulerStats(3)), UtilityResult(9, error="x"),
        EngineDead("gone"), EngineStartupError("ValidationError", "too long", "max_model_len")]


@pytest.mark.parametrize("message", FRONTEND, ids=lambda m: type(m).__name__)
def test_frontend_messages_round_trip(message):
    assert Decoder(FrontendMessage).decode(Encoder().encode(message)) == message


@pytest.mark.parametrize("message", CORE, ids=lambda m: type(m).__name__)
def test_core_messages_round_trip(message):
    assert Decoder(CoreMessage).decode(Encoder().encode(message)) == message


def test_step_messages_round_trip():
    step = StepInput(num_scheduled_tokens={"a": 3}, finished_req_ids=["b"])
    assert Decoder(StepInput).decode(Encoder().encode(step)) == step
    out = StepOutput(["a"], [[4]], {"c": "nan"})
    assert Decoder(StepOutput).decode(Encoder().encode(out)) == out


class WithArrays(msgspec.Struct, array_like=True):
    small: np.ndarray
    big: np.ndarray
    tag: str


def test_arrays_travel_as_extra_frames():
    big = np.arange(4096, dtype=np.float32).reshape(64, 64)
    message = WithArrays(np.array([1, 2, 3], np.int64), big, "t")
    frames = Encoder().encode(message)
    assert len(frames) == 2 and frames[1] is big   # sent without a copy
    assert len(frames[0]) < INLINE_ARRAY_BYTES  # the big array is not inside frame 0
    decoded = Decoder(WithArrays).decode([bytes(frames[0]), frames[1].tobytes()])
    assert decoded.tag == "t" and decoded.small.tolist() == [1, 2, 3]
    assert decoded.big.dtype == np.float32 and np.array_equal(decoded.big, big)


def test_ipc_addresses_are_short_and_removable():
    addresses = IpcAddresses.create()
    try:
        assert len(addresses.handshake) < 100 and addresses.exists()
    finally:
        addresses.remove()
    assert not addresses.exists()


def test_errors_keep_their_type_across_processes():
    e = error_from_wire("ValidationError", "max_model_len too big", "max_model_len")
    assert type(e) is ValidationError and str(e) == "max_model_len too big"
    assert e.param == "max_model_len"
    assert type(error_from_wire("ModelNotFoundError", "x.gguf: missing")) is ModelNotFoundError
    other = error_from_wire("ZeroDivisionError", "division by zero")
    assert type(other) is VllmActorsError and "ZeroDivisionError" in str(other)


def test_n_completions_travel_as_one_encoded_copy():
    """A request's n completions are one message: its encoded size does not grow with n,
    and the core derives the children's ids from it."""
    params = SamplingParams(n=1, stop_token_ids=list(range(5000)), stop=["a"] * 100,
                            bad_words_token_ids=[[i, i + 1] for i in range(2000)])
    sizes = {}
    for n in (1, 2, 128):
        message = EngineCoreRequest("r", [1, 2, 3], params, [2], 1.5, n=n)
        frames = Encoder().encode(message)
        sizes[n] = sum(len(f) for f in frames)
        decoded = Decoder(FrontendMessage).decode(frames)
        assert decoded == message and decoded.n == n
    assert sizes[128] - sizes[1] <= 2 and sizes[1] > 10_000
    assert EngineCoreRequest("r", [1], params, [], 0.0, n=3).child_request_ids == \
        ["0_r", "1_r", "2_r"]
    assert EngineCoreRequest("r", [1], params, [], 0.0).child_request_ids == ["r"]


def test_siblings_params_travel_to_workers_once():
    """New requests that share params in one step carry them once (`params_from`); the
    worker side resolves them to one object."""
    from vllm_actors.protocol.step import NewRequestData
    params = SamplingParams(n=3, seed=4, bad_words_token_ids=[[i] for i in range(3000)])
    first = NewRequestData("0_r", [1, 2], params, [[1]], 0, 2, [2])
    siblings = [NewRequestData(f"{i}_r", [1, 2], SamplingParams(), [[i + 1]], 0, 2, [2],
                               child_index=i, params_from="0_r") for i in (1, 2)]
    one = Encoder().encode(StepInput(new_requests=[first]))
    step = StepInput(new_requests=[first, *siblings])
    frames = Encoder().encode(step)
    assert len(frames[0]) - len(one[0]) < 100
    decoded = Decoder(StepInput).decode(frames)
    resolved = decoded.new_request_params()
    assert resolved[0] == params and resolved[1] is resolved[0] and resolved[2] is resolved[0]
    assert [n.child_index for n in decoded.new_requests] == [0, 1, 2]
