"""`serve --speculative-config`: a streamed chat through the official openai client gives the
same message as the whole response and as the server without speculation, /metrics counts
drafts under vLLM's names, and a bad config stops the server with one clear line."""

import json
import re
import subprocess
import sys

import httpx
import openai
from oracle.prompts import LONG_ESSAY
from server_process import API_KEY, ServerProcess

CONFIG = {"method": "suffix", "num_speculative_tokens": 8}
MESSAGES = [{"role": "user", "content": "Copy this text exactly, nothing else:\n\n"
             + LONG_ESSAY[:500]}]


def test_streamed_chat_with_drafts(smollm2_path, client):
    server = ServerProcess(str(smollm2_path), "--api-key", API_KEY, "--served-model-name",
                           "smol", "--speculative-config", json.dumps(CONFIG),
                           "--gguf-activations", "float32")     # as the `client` server
    try:
        spec = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        args = {"model": "smol", "messages": MESSAGES, "temperature": 0, "max_tokens": 80}
        whole = spec.chat.completions.create(**args).choices[0].message.content
        chunks = [c.choices[0].delta.content or "" for c in
                  spec.chat.completions.create(**args, stream=True) if c.choices]
        plain = client.chat.completions.create(**args).choices[0].message.content
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
    finally:
        assert server.stop() == 0, server.log()
    assert "".join(chunks) == whole == plain
    accepted = re.search(r'^vllm:spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)$',
                         metrics, re.M)
    assert accepted and float(accepted.group(1)) > 0
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in metrics


def test_bad_config_is_refused_at_start(smollm2_path):
    done = subprocess.run([sys.executable, "-m", "vllm_actors", "serve", str(smollm2_path),
                           "--speculative-config", '{"method": "eagle"}'],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert 'method "eagle" is not implemented' in done.stderr
    assert "Traceback" not in done.stderr
