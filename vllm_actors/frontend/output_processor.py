"""OutputProcessor: engine outputs -> per-request `RequestOutput`s with detokenized text."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_actors.frontend.detokenizer import IncrementalDetokenizer
from vllm_actors.loaders.tokenizer import Tokenizer
from vllm_actors.outputs import CompletionOutput, RequestOutput
from vllm_actors.protocol.engine import EngineCoreOutput, EngineCoreRequest


@dataclass
class _RequestState:
    output: RequestOutput
    detokenizer: IncrementalDetokenizer


class OutputProcessor:
    """Tracks every request the frontend has in flight."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}

    def add_request(self, request: EngineCoreRequest, prompt: str | None) -> None:
        completion = CompletionOutput(index=0, text="", token_ids=[])
        output = RequestOutput(request.request_id, prompt, request.prompt_token_ids, [completion])
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                       request.sampling_params.skip_special_tokens)
        self.requests[request.request_id] = _RequestState(output, detok)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Mark requests aborted and stop tracking them; returns their final outputs."""
        aborted = []
        for req_id in request_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                state.output.outputs[0].finish_reason = "abort"
                state.output.finished = True
                aborted.append(state.output)
        return aborted

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> list[tuple[RequestOutput, str]]:
        """Apply one step's outputs. Returns (updated output, new text) per touched request;
        finished requests are no longer tracked afterwards."""
        updated = []
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:
                continue
            completion = state.output.outputs[0]
            completion.token_ids.extend(out.new_token_ids)
            delta = state.detokenizer.update(out.new_token_ids, finished=out.finished)
            completion.text = state.detokenizer.text
            state.output.num_cached_tokens = out.num_cached_tokens
            if out.finished:
                completion.finish_reason = str(out.finish_reason)
                completion.stop_reason = out.stop_reason
                state.output.finished = True
                del self.requests[out.request_id]
            updated.append((state.output, delta))
        return updated
