"""The first scheduler (one request at a time) and the stop rules, with exact values."""

from vllm_actors.enginecore.request import Request
from vllm_actors.enginecore.scheduler import Scheduler
from vllm_actors.protocol.engine import EngineCoreRequest, FinishReason
from vllm_actors.protocol.step import StepOutput
from vllm_actors.sampling_params import SamplingParams


def make_request(req_id: str, num_prompt: int, max_model_len: int = 64, **params) -> Request:
    sp = SamplingParams(temperature=0.0, **params)
    return Request(EngineCoreRequest(req_id, list(range(10, 10 + num_prompt)), sp, [2], 0.0),
                   max_model_len)


def test_stop_rule_order():
    r = make_request("a", 3, max_tokens=2, min_tokens=1, stop_token_ids=[7])
    r.append_output_token(2)          # EOS counts once min_tokens is met
    assert r.check_stop() and r.finish_reason == FinishReason.STOP and r.stop_reason is None
    r = make_request("b", 3, max_tokens=5, min_tokens=2, stop_token_ids=[7])
    r.append_output_token(7)          # before min_tokens: ignored
    assert not r.check_stop()
    r.append_output_token(7)
    assert r.check_stop() and r.stop_reason == 7
    r = make_request("c", 3, max_tokens=1)
    r.append_output_token(2)          # length wins over EOS on the last allowed token
    assert r.check_stop() and r.finish_reason == FinishReason.LENGTH
    r = make_request("d", 3, ignore_eos=True, max_tokens=4)
    r.append_output_token(2)
    assert not r.check_stop()
    r = make_request("e", 60, max_model_len=62, max_tokens=None)
    assert r.max_tokens == 2


def test_one_request_at_a_time_with_block_accounting():
    s = Scheduler(num_kv_blocks=6, block_size=4, max_model_len=16)
    s.add_request(make_request("a", 5, max_tokens=3))
    s.add_request(make_request("b", 2, max_tokens=1))
    step = s.schedule()
    assert [n.req_id for n in step.new_requests] == ["a"]
    assert step.new_requests[0].block_ids == [1, 2]
    assert step.num_scheduled_tokens == {"a": 5}
    outs = s.update_from_output(step, StepOutput(["a"], [[40]]))
    assert outs[0].new_token_ids == [40] and outs[0].finish_reason is None
    step = s.schedule()                                  # decode: position 5 fits block 2
    assert step.cached_requests.req_ids == ["a"] and step.cached_requests.new_block_ids == [[]]
    assert step.num_scheduled_tokens == {"a": 1}
    s.update_from_output(step, StepOutput(["a"], [[41]]))
    step = s.schedule()
    s.update_from_output(step, StepOutput(["a"], [[42]]))  # third token: max_tokens
    assert list(s.free_block_ids) == [3, 4, 5, 6, 2, 1]    # freed in reverse order
    step = s.schedule()
    assert step.finished_req_ids == ["a"]
    assert [n.req_id for n in step.new_requests] == ["b"] and step.new_requests[0].block_ids == [3]


def test_abort_is_idempotent_and_frees_blocks():
    s = Scheduler(num_kv_blocks=4, block_size=4, max_model_len=16)
    s.add_request(make_request("a", 5))
    s.add_request(make_request("b", 5))
    s.schedule()
    s.finish_requests(["a", "b", "a", "zzz"], FinishReason.ABORT)
    assert not s.has_requests()
    assert sorted(s.free_block_ids) == [1, 2, 3, 4]
    assert s.schedule().finished_req_ids == ["a"]  # only "a" ever reached the worker
