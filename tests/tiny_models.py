"""Tiny random-weight models and vocabularies that tests (and tests/oracle/make_golden.py) build
themselves. Weights come from splitmix64 integer hashing, so they are identical on every
machine and numpy version (no RNG stream involved)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # llama with llama3 rope scaling, written with the older rope_theta / rope_scaling keys
    "llama": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 96, "vocab_size": 256, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
        "intermediate_size": 128, "vocab_size": 256, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 256, "tie_word_embeddings": True,
        "hidden_act": "silu", "use_sliding_window": False, "torch_dtype": "float32",
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "intermediate_size": 96, "vocab_size": 256, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 256, "tie_word_embeddings": True,
        "attention_bias": False, "hidden_act": "silu", "torch_dtype": "float32",
    },
    # mistral with linear rope scaling, written with transformers 5's rope_parameters
    "mistral": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 96, "vocab_size": 256, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        "max_position_embeddings": 256, "tie_word_embeddings": False, "sliding_window": None,
        "hidden_act": "silu", "torch_dtype": "float32",
    },
}

# Token ids the oracle runs over: covers positions 0..39 (RoPE beyond the trivial position 0).
TINY_PROMPT = [(i * 37 + 11) % 256 for i in range(40)]


def det_uniform(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Deterministic float32 values in [-1, 1) from splitmix64 of (seed, index)."""
    n = int(np.prod(shape))
    with np.errstate(over="ignore"):
        z = (np.arange(n, dtype=np.uint64) + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)) \
            * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    top = (z >> np.uint64(40)).astype(np.float64)  # 24 bits
    return (top / float(1 << 23) - 1.0).astype(np.float32).reshape(shape)


def tiny_weights(config: dict[str, Any]) -> dict[str, np.ndarray]:
    """HF-named float32 weights for a tiny config."""
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    h, hk = config["num_attention_heads"], config["num_key_value_heads"]
    dh = config.get("head_dim") or d // h
    seed = iter(range(1, 10_000))
    arch = config["architectures"][0]

    def linear(out: int, inp: int) -> np.ndarray:
        return det_uniform((out, inp), next(seed)) * np.float32(1.5 / math.sqrt(inp))

    def norm(n: int) -> np.ndarray:
        return np.float32(1.0) + np.float32(0.2) * det_uniform((n,), next(seed))

    w = {"model.embed_tokens.weight": det_uniform((v, d), next(seed)),
         "model.norm.weight": norm(d)}
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = linear(v, d)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(d)
        w[p + "post_attention_layernorm.weight"] = norm(d)
        w[p + "self_attn.q_proj.weight"] = linear(h * dh, d)
        w[p + "self_attn.k_proj.weight"] = linear(hk * dh, d)
        w[p + "self_attn.v_proj.weight"] = linear(hk * dh, d)
        w[p + "self_attn.o_proj.weight"] = linear(d, h * dh)
        if arch == "Qwen2ForCausalLM":
            for name, n in (("q_proj", h * dh), ("k_proj", hk * dh), ("v_proj", hk * dh)):
                w[p + f"self_attn.{name}.bias"] = np.float32(0.3) * det_uniform((n,), next(seed))
        if arch == "Qwen3ForCausalLM":
            w[p + "self_attn.q_norm.weight"] = norm(dh)
            w[p + "self_attn.k_norm.weight"] = norm(dh)
        w[p + "mlp.gate_proj.weight"] = linear(f, d)
        w[p + "mlp.up_proj.weight"] = linear(f, d)
        w[p + "mlp.down_proj.weight"] = linear(d, f)
    return w


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str = "F32") -> None:
    """A safetensors file (F32 or BF16, BF16 by truncation) without the safetensors package."""
    header: dict[str, Any] = {}
    blobs, offset = [], 0
    for name, array in tensors.items():
        array = np.ascontiguousarray(array, np.float32)
        raw = (array.view(np.uint32) >> np.uint32(16)).astype(np.uint16).tobytes() \
            if dtype == "BF16" else array.tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header_bytes = json.dumps(header).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(len(header_bytes).to_bytes(8, "little"))
        f.write(header_bytes)
        for blob in blobs:
            f.write(blob)


def write_checkpoint(path: Path, config: dict[str, Any], weights: dict[str, np.ndarray]
                     ) -> dict[str, np.ndarray]:
    """An HF directory: config.json + model.safetensors; returns the weights."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    write_safetensors(path / "model.safetensors", weights)
    return weights


def write_hf_dir(path: Path, name: str) -> dict[str, np.ndarray]:
    """config.json + model.safetensors for TINY_CONFIGS[name]; returns the weights."""
    return write_checkpoint(path, TINY_CONFIGS[name], tiny_weights(TINY_CONFIGS[name]))


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter row order for Q/K: within each head, halves -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]) \
        .swapaxes(1, 2).reshape(w.shape)


def llama3_freq_factors(config: dict[str, Any]) -> np.ndarray:
    """What llama.cpp's converter stores as rope_freqs.weight for llama3 rope scaling."""
    s = config["rope_scaling"]
    dh = config["hidden_size"] // config["num_attention_heads"]
    base = 1.0 / (config["rope_theta"] ** (np.arange(0, dh, 2, dtype=np.float64) / dh))
    wavelen = 2 * math.pi / base
    low_wl = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wl = s["original_max_position_embeddings"] / s["high_freq_factor"]
    smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / \
        (s["high_freq_factor"] - s["low_freq_factor"])
    factors = np.where(wavelen < high_wl, 1.0,
                       np.where(wavelen > low_wl, s["factor"],
                                1.0 / ((1 - smooth) / s["factor"] + smooth)))
    return factors.astype(np.float32)


def write_gguf(path: Path, arch: str, fill: Any) -> None:
    """A GGUF file for `arch`; `fill(writer)` adds metadata and tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    fill(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_llama_gguf(path: Path, qtype: Any = None, no_vocab: bool = False) -> None:
    """TINY_CONFIGS["llama"] as a llama.cpp-style GGUF: GGUF names, Q/K rows permuted, llama3
    scaling as rope_freqs factors. `qtype` (a GGMLQuantizationType) quantizes the 2-D weights
    (IQ4_NL with `quant_blocks.quantize_iq4_nl`). `no_vocab`: tokenizer.ggml.model "none",
    which llama.cpp needs to load a file without a vocabulary."""
    import gguf
    from quant_blocks import quantize_iq4_nl

    config = TINY_CONFIGS["llama"]
    weights = tiny_weights(config)
    n_layers = config["num_hidden_layers"]
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(n_layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_tensor("rope_freqs.weight", llama3_freq_factors(config))
    if no_vocab:
        writer.add_tokenizer_model("none")
    for hf_name, w in weights.items():
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name.endswith("attn_q.weight"):
            w = llama_cpp_permute(w, config["num_attention_heads"])
        elif name.endswith("attn_k.weight"):
            w = llama_cpp_permute(w, config["num_key_value_heads"])
        if qtype is not None and w.ndim == 2:
            packed = quantize_iq4_nl(w) if qtype == gguf.GGMLQuantizationType.IQ4_NL \
                else gguf.quants.quantize(w, qtype)
            writer.add_tensor(name, packed, raw_dtype=qtype)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


SPM_PIECES = ["\u2581", "\u2581t", "he", "\u2581the", "\u2581a", "in", "\u2581in", "er",
              "\u2581w", "or", "\u2581wor", "ld", "\u2581world", "\u2581h", "el", "lo",
              "\u2581hel", "\u2581hello", "an", "\u2581an", "d", "\u2581and", "ing", "\u2581s",
              "t", "h", "e", "a", "i", "n", "r", "w", "o", "l", "s", "g", "c", "at", "\u2581c",
              "\u2581cat", "\u2581sat", "\u2581on", "\u2581mat", "m", ".", ","]


def write_spm_vocab_gguf(path: Path) -> None:
    """A vocabulary-only GGUF with a SentencePiece-style ("llama") tokenizer: no merges, byte
    fallback tokens, scores that rank longer pieces first. No tensors."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(8)
    writer.add_head_count(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
