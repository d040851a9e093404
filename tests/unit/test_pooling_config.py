"""Pooling settings: PoolingParams' checks, --runner / --task / --convert, --pooler-config and
sentence-transformers' pooling module, right truncation that keeps special tokens, and the
pairing of score inputs."""

import json

import pytest

from vllm_actors.config import EngineArgs
from vllm_actors.errors import ValidationError
from vllm_actors.frontend.input_processor import _cut_right
from vllm_actors.frontend.pooling_tasks import pair_up
from vllm_actors.models.pooler import PoolerConfig, resolve_pooler_config
from vllm_actors.pooling_params import PoolingParams


@pytest.mark.parametrize("kwargs,param", [
    ({"task": "summarize"}, "task"), ({"dimensions": 0}, "dimensions"),
    ({"dimensions": True}, "dimensions"), ({"truncate_prompt_tokens": -2},
                                           "truncate_prompt_tokens")])
def test_pooling_params_refuse_bad_values(kwargs, param):
    with pytest.raises(ValidationError) as e:
        PoolingParams(**kwargs)
    assert e.value.param == param


def test_vllm_0_11_task_name():
    assert PoolingParams(task="token_embed").task == "encode"


def test_runner_from_task_and_convert():
    runner = lambda **kw: EngineArgs(**kw).create_engine_config().model.runner  # noqa: E731
    assert runner() == "auto"
    assert runner(task="embed") == runner(task="score") == runner(convert="embed") == "pooling"
    assert runner(task="generate") == "generate"
    for bad in ({"task": "embed", "runner": "generate"}, {"convert": "embed", "runner":
                                                          "generate"}):
        with pytest.raises(ValidationError):
            EngineArgs(**bad).create_engine_config()


def test_pooler_config_sources(tmp_path):
    assert resolve_pooler_config(None, "CLS") == PoolerConfig("CLS")
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"path": "", "type": "sentence_transformers.models.Transformer"},
         {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}))
    assert resolve_pooler_config(tmp_path, "CLS").pooling_type == "MEAN"
    assert resolve_pooler_config(tmp_path, "CLS", '{"pooling_type": "last", "normalize": '
                                                  'false}') == PoolerConfig("LAST", False)
    for bad in ('{"pooling_type": "MAX"}', '{"pool": 1}', "[1]", "{"):
        with pytest.raises(ValidationError) as e:
            resolve_pooler_config(tmp_path, "CLS", bad)
        assert e.value.param == "pooler_config"


def test_right_truncation_keeps_special_tokens():
    # [CLS] a b c d [SEP] cut to 4: [CLS] a b [SEP]
    assert _cut_right([101, 1, 2, 3, 4, 102], [1, 2, 3, 4], 4) == [101, 1, 2, 102]
    assert _cut_right([1, 2, 3, 4], [1, 2, 3, 4], 2) == [1, 2]          # no special tokens
    assert _cut_right([9, 1, 2, 3], [1, 2, 3], 3) == [9, 1, 2]          # a prefix only


def test_score_pairing():
    assert pair_up("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert pair_up(["q", "r"], ["a", "b"]) == [("q", "a"), ("r", "b")]
    for first, second in ((["q", "r"], ["a", "b", "c"]), ([], ["a"])):
        with pytest.raises(ValidationError):
            pair_up(first, second)
