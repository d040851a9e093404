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
