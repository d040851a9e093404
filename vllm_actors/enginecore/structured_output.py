"""Structured outputs in the engine core: grammars compiled off the busy loop, one token
bitmask per step for the requests that sample, matchers advanced by the sampled tokens.

A request with `structured_outputs` waits here, outside the scheduler, until its grammar is
compiled (llguidance, which releases the GIL, off the busy loop on one of grammar.py's
big-stack threads, under the same limits the frontend checks); it then joins the waiting queue
with its matcher attached (`Request.grammar`). A grammar that fails to compile finishes
its request with an error. Each step, `bitmask()` writes one row of allowed-token bits per
sampling request (bit t of word t // 32 set = token t allowed) and the worker masks the
logits with it; `Request.append_output_token` advances the matcher and `check_stop` ends the
request when the grammar is complete. With speculative decoding a request's drafts are
checked against its grammar before they are scheduled (`DraftPolicy`) and it gets one mask
per sampled position.

The tokenizer (needed to map grammar bytes to token ids) is loaded on the first structured
request, on the same worker thread.
"""

from __future__ import annotations

import concurrent.futures as cf

import llguidance
import numpy as np

from vllm_actors.enginecore.request import Request
from vllm_actors.errors import ValidationError
from vllm_actors.grammar import compile_matcher
from vllm_actors.loaders.model_files import resolve_model
from vllm_actors.loaders.tokenizer import load_tokenizer, tokenizer_source
from vllm_actors.sampling_params import StructuredOutputsParams


class StructuredOutputManager:
    """Args:
        model: the model path (None: the default model), for its tokenizer.
        vocab_size: the model's vocabulary (logits width); bitmask rows cover it.
    """

    def __init__(self, model: str | None, vocab_size: int, tokenizer: str | None = None
                 ) -> None:
        self.model = model
        self.tokenizer_arg = tokenizer     # --tokenizer: where the frontend reads it too
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self.pool = cf.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.tokenizer: llguidance.LLTokenizer | None = None
        self.pending: dict[str, tuple[Request, cf.Future]] = {}
        self.executor: llguidance.LLExecutor | None = None

    def submit(self, request: Request) -> None:
        """Start compiling the request's grammar; it is held until `take_ready`. The n
        completions of one request (one params object) share one compile, each taking a
        copy of the matcher."""
        params = request.params.structured_outputs
        assert params is not None
        future = next((f for r, f in self.pending.values() if r.params is request.params),
                      None)
        if future is None:
            future = self.pool.submit(self._compile, params, request.grammar_spec)
        self.pending[request.request_id] = (request, future)

    def _compile(self, params: StructuredOutputsParams, grammar: str | None
                 ) -> llguidance.LLMatcher:
        if self.tokenizer is None:
            source = tokenizer_source(resolve_model(self.model), self.tokenizer_arg)
            tok = load_tokenizer(source)
            self.tokenizer = llguidance.LLTokenizer(
                tok.backend.to_str(), n_vocab=max(self.vocab_size, tok.vocab_size),
                eos_token=list(tok.eos_token_ids) or None)
        # the frontend validated the grammar; the matcher reports whatever it still refuses
        return compile_matcher(self.tokenizer, params, grammar)

    def has_pending(self) -> bool:
        return bool(self.pending)

    def wait(self, timeout: float) -> None:
        """Block until a pending grammar is compiled, at most `timeout` seconds."""
        cf.wait([f for _, f in self.pending.values()], timeout, cf.FIRST_COMPLETED)

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """(requests whose matcher is ready, (request, error) for failed grammars)."""
        ready, failed, taken = [], [], set()
        for req_id, (request, future) in list(self.pending.items()):
            if not future.done():
                continue
            del self.pending[req_id]
            try:
                shared = any(f is future for _, f in self.pending.values()) or \
                    future in taken
                request.grammar = future.result().deep_copy() if shared else future.result()
                taken.add(future)
                ready.append(request)
            except Exception as e:   # any compile failure is this request's alone
                failed.append((request, str(e) if isinstance(e, ValidationError)
                               else f"the grammar could not be compiled: {e}"))
        return ready, failed

    def abort(self, request_ids: list[str]) -> list[str]:
        """Forget pending requests; returns the ids that were pending."""
        found = [r for r in request_ids if r in self.pending]
        for req_id in found:
            future = self.pending.pop(req_id)[1]
            if all(f is not future for _, f in self.pending.values()):   # no sibling waits
                future.cancel()
        return found

    def bitmask(self, requests: list[Request], drafts: list[list[int]] | None = None) -> bytes:
        """Allowed-token bits [rows, num_words] int32 for requests about to sample, as bytes
        (the worker reads them with np.frombuffer): one row per request, or with `drafts`
        (per request, speculative decoding) 1 + len(drafts) consecutive rows, the mask
        after each draft (the matcher is advanced through the drafts and rolled back)."""
        sizes = [1] * len(requests) if drafts is None else [1 + len(d) for d in drafts]
        mask = np.full((sum(sizes), self.num_words), -1, np.int32)
        if self.executor is None:
            self.executor = llguidance.LLExecutor()   # threads: 80 % of the cores, <= 32
        starts = np.cumsum([0] + sizes[:-1]).tolist()
        if drafts is None or not any(drafts):
            self.executor.unsafe_compute_mask_ptr(
                [(r.grammar, k) for r, k in zip(requests, starts)], mask.ctypes.data,
                self.num_words * 4, len(mask))
        else:
            self.executor.unsafe_compute_mask_ptr_with_draft_token(
                [(r.grammar, k, d) for r, k, d in zip(requests, starts, drafts)],
                mask.ctypes.data, self.num_words * 4, len(mask))
        return mask.tobytes()
