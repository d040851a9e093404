"""Our GGUF reader against gguf-py's GGUFReader, and the typed errors for bad files."""

import shutil

import gguf
import numpy as np
import pytest
from tiny_models import write_gguf, write_llama_gguf

from vllm_actors.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError
from vllm_actors.kernels.numpy_backend import NumpyBackend
from vllm_actors.loaders.gguf import GGUFFile
from vllm_actors.loaders.model_files import resolve_model
from vllm_actors.loaders.weights import gguf_weights
from vllm_actors.models.registry import load_model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_llama_gguf(path)
    return path


def test_matches_gguf_py_on_smollm2(smollm2_path):
    ours = GGUFFile(smollm2_path)
    ref = gguf.GGUFReader(smollm2_path)
    assert ours.metadata["tokenizer.ggml.tokens"] == \
        [str(bytes(ref.fields["tokenizer.ggml.tokens"].parts[i]), "utf-8")
         for i in ref.fields["tokenizer.ggml.tokens"].data]
    assert ours.metadata["general.architecture"] == "llama"
    assert ours.arch_get("block_count") == 30
    assert ours.data_offset == ref.data_offset
    assert len(ours.tensors) == len(ref.tensors) == 272
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert info.ggml_type == int(t.tensor_type)
        assert info.offset == int(t.data_offset)  # gguf-py reports absolute offsets
        assert info.nbytes == int(t.n_bytes)
        assert np.array_equal(ours.raw(t.name).reshape(-1).view(np.uint8),
                              np.asarray(t.data).reshape(-1).view(np.uint8))


def test_missing_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match="nope.gguf: no such GGUF file"):
        GGUFFile(tmp_path / "nope.gguf")
    with pytest.raises(ModelNotFoundError, match="no such model file or directory"):
        resolve_model(tmp_path / "nope.gguf")


def test_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ModelFormatError, match=r"model.gguf: not a GGUF file"):
        GGUFFile(path)


@pytest.mark.parametrize("keep_fraction, message", [(0.002, "truncated GGUF header"),
                                                    (0.9, "truncated: tensor")])
def test_truncated(tiny_gguf, tmp_path, keep_fraction, message):
    path = tmp_path / "cut.gguf"
    data = tiny_gguf.read_bytes()
    path.write_bytes(data[:max(32, int(len(data) * keep_fraction))])
    with pytest.raises(ModelFormatError, match=message) as err:
        GGUFFile(path)
    assert str(path) in str(err.value)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_gguf(path, "mamba", lambda w: w.add_tensor("token_embd.weight", np.ones((4, 8),
                                                                                np.float32)))
    with pytest.raises(UnsupportedModelError, match=r"mamba.gguf: architecture 'mamba' is not "
                                                    r"supported; supported: .*llama"):
        load_model(resolve_model(path), NumpyBackend())


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "int.gguf"
    write_gguf(path, "llama", lambda w: w.add_tensor("blk.0.attn_q.weight",
                                                    np.ones((4, 8), np.int32)))
    with pytest.raises(UnsupportedModelError, match=r"int.gguf: tensor 'blk.0.attn_q.weight' "
                                                    r"has type I32"):
        gguf_weights(GGUFFile(path))


def test_missing_tensor_is_named(tiny_gguf, tmp_path):
    path = tmp_path / "partial.gguf"
    reader = GGUFFile(tiny_gguf)

    def fill(writer):
        for key in ("block_count", "context_length", "embedding_length", "feed_forward_length",
                    "attention.head_count", "attention.head_count_kv"):
            writer.add_uint32(f"llama.{key}", int(reader.arch_get(key)))
        for name in ("token_embd.weight", "output_norm.weight"):
            writer.add_tensor(name, reader.raw(name).copy())

    write_gguf(path, "llama", fill)
    with pytest.raises(ModelFormatError, match=r"partial.gguf: missing tensor 'blk.0.attn_q"):
        load_model(resolve_model(path), NumpyBackend())


def test_safetensors_dir_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="model directory has no config.json") as err:
        resolve_model(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_copy_of_tiny_gguf_loads(tiny_gguf, tmp_path):
    copy = tmp_path / "copy.gguf"
    shutil.copy(tiny_gguf, copy)
    model = load_model(resolve_model(copy), NumpyBackend())
    assert model.args.num_layers == 2 and model.args.rope_interleaved
