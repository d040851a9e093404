"""Token sampling in vLLM's order, vectorized over the batch; only the controls some row uses
are run.

    1. raw logprobs (log-softmax of the model's logits) for rows that asked for logprobs
    2. allowed_token_ids, bad_words, min_tokens (stop ids masked), logit_bias
    3. repetition, frequency and presence penalties
    4. greedy rows: argmax (before temperature)
    5. random rows: temperature, min_p, top_k, top_p, then the exponential race
       argmax(p / q), q ~ Exp(1), over the tokens still possible; a seeded row draws q from a
       generator keyed by (seed, output index), so its tokens do not depend on the batch,
       chunking or preemption.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from vllm_actors.workers.sampling_state import SamplingState

logger = logging.getLogger(__name__)

Failures = dict[int, tuple[str, str | None]]   # row -> (reason, request field at fault)

_F32_MAX = np.float32(np.finfo(np.float32).max)
NOTHING_LEFT = ("no token is left to sample: allowed_token_ids, bad_words, min_tokens and "
                "logit_bias exclude every token", "allowed_token_ids")

@dataclass
class SampledLogprobs:
    """For the `rows` (indices into the sampled batch) that asked for logprobs.

    token_ids / logprobs: [n, k+1], the sampled token first, then the top k (k = the largest
    request in the batch; a request keeps its own first k). ranks: [n], 1-based rank of the
    sampled token in the raw distribution.
    """

    rows: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray
    ranks: np.ndarray


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def top_logprobs(lp: np.ndarray, chosen: np.ndarray, k: int) -> tuple[np.ndarray, ...]:
    """Sampled ids `chosen` [n] first, then each row's k best: ids, logprobs, sampled ranks."""
    n = len(lp)
    picked = lp[np.arange(n), chosen]
    ranks = (lp > picked[:, None]).sum(axis=1) + 1
    ids = chosen[:, None]
    if k > 0:
        best = _best_by_argmax(lp, k) if k <= _ARGMAX_TOP_K else _best_by_partition(lp, k)
        ids = np.concatenate([ids, best], axis=1)
    return ids, np.take_along_axis(lp, ids, axis=1), ranks


# Up to this k the best ids come from k passes of argmax (vectorized, in the row's order)
# rather than a partition of every row, which is far slower over a prompt's rows
_ARGMAX_TOP_K = 32


def _best_by_argmax(lp: np.ndarray, k: int) -> np.ndarray:
    """Each row's k largest ids [n, k], best first, ties to the lower id: argmax, the found
    entry set to -inf, again (`lp` restored before returning). A row with fewer than k
    values above -inf (a grammar's mask) would find one -inf id twice: such rows are
    partitioned instead."""
    n = len(lp)
    rows = np.arange(n)
    best = np.empty((n, k), np.int64)
    taken = np.empty((n, k), lp.dtype)
    for j in range(k):
        best[:, j] = lp.argmax(axis=1)
        taken[:, j] = lp[rows, best[:, j]]
        lp[rows, best[:, j]] = -np.inf
    for j in range(k - 1, -1, -1):          # last found first: a row may repeat an id
        lp[rows, best[:, j]] = taken[:, j]
    short = np.flatnonzero(np.isneginf(taken[:, -1]))
    if len(short):
        best[short] = _best_by_partition(lp[short], k)
    return best


def _best_by_partition(lp: np.ndarray, k: int) -> np.ndarray:
    """Each row's k largest ids [n, k], best first (distinct ids whatever the values)."""
    top = np.argpartition(-lp, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(lp, top, axis=1), axis=1, kind="stable")
    return np.take_along_axis(top, order, axis=1)


def output_counts(token_ids: np.ndarray, rows: np.ndarray, starts: np.ndarray,
                  ends: np.ndarray, vocab: int) -> np.ndarray:
    """[n, vocab] counts of token_ids[rows[i], starts[i]:ends[i]] per entry i (one
    bincount)."""
    lengths = ends - starts
    entry = np.repeat(np.arange(len(starts)), lengths)
    cols = np.repeat(starts, lengths) + (np.arange(len(entry)) - np.repeat(
        np.cumsum(lengths) - lengths, lengths))
    flat = entry * vocab + token_ids[rows[entry], cols]
    return np.bincount(flat, minlength=len(starts) * vocab).reshape(len(starts), vocab)


def apply_token_bitmask(logits: np.ndarray, rows: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """Set logits[rows[i], t] = -inf where bit t of bitmask[i] is clear (int32 words, bit
    t % 32 of word t // 32; see StepInput.grammar_bitmask). Returns the indices into rows
    whose mask allows no token at all."""
    vocab = logits.shape[1]
    # inverting the packed words is 8x less work than inverting the unpacked bits
    disallowed = np.unpackbits(np.invert(bitmask.view(np.uint8)), axis=1, count=vocab,
                               bitorder="little").view(bool)
    if len(rows) == len(logits) and (rows == np.arange(len(rows))).all():
        np.putmask(logits, disallowed, -np.inf)
    else:
        sub = logits[rows]
        np.putmask(sub, disallowed, -np.inf)
        logits[rows] = sub
    return np.flatnonzero(disallowed.all(axis=1))


class Sampler:
    def __init__(self, seed: int) -> None:
        self.shared_generator = np.random.default_rng(seed)

    def sample(self, logits: np.ndarray, batch_rows: np.ndarray, state: SamplingState,
               token_ids: np.ndarray, num_prompt: np.ndarray, num_tokens: np.ndarray,
               num_drafted: np.ndarray | None = None
               ) -> tuple[np.ndarray, SampledLogprobs | None, Failures]:
        """logits [n, V] float32 for persistent-batch rows `batch_rows` [n]; token_ids is the
        batch's [rows, max_len] token matrix with each row's prompt / total lengths.
        num_drafted [n] (speculative decoding): entry i samples after that many of its row's
        drafts, which token_ids holds after the row's tokens; they count as outputs (for
        penalties, min_tokens, bad words and a seeded row's output index). Rows may repeat.
        Returns the sampled ids [n], their logprobs when asked, and the rows (indices into
        logits) that could not be sampled (their ids are -1), with the reason and the
        request field at fault (None when the sampler itself failed).

        One row's controls cannot fail the others: if sampling the batch raises, each row is
        sampled on its own and only the rows that still raise fail."""
        ends = num_tokens[batch_rows] if num_drafted is None else \
            num_tokens[batch_rows] + num_drafted
        args = (state, token_ids, num_prompt, ends)
        try:
            return self._sample(logits, batch_rows, *args)
        except Exception:
            logger.exception("sampling a batch of %d failed; sampling its rows one by one",
                             len(batch_rows))
        sampled = np.full(len(batch_rows), -1, np.int64)
        failed: Failures = {}
        pieces = []
        for i in range(len(batch_rows)):
            try:
                ids, lp, bad = self._sample(logits[i:i + 1], batch_rows[i:i + 1], state,
                                           token_ids, num_prompt, ends[i:i + 1])
            except Exception as e:
                failed[i] = (f"sampling failed for this request: {type(e).__name__}: {e}",
                             None)
                continue
            sampled[i] = ids[0]
            if bad:
                failed[i] = bad[0]
            elif lp is not None:
                pieces.append((i, lp))
        return sampled, _stack_logprobs(pieces), failed

    def _sample(self, logits: np.ndarray, rows: np.ndarray, state: SamplingState,
                token_ids: np.ndarray, num_prompt: np.ndarray, ends: np.ndarray
                ) -> tuple[np.ndarray, SampledLogprobs | None, Failures]:
        """ends [n]: each entry's context length (its row's tokens and drafts before it)."""
        num_out = ends - num_prompt[rows]
        want_lp = np.flatnonzero(state.num_logprobs[rows] >= 0)
        raw_lp = log_softmax(logits[want_lp]) if len(want_lp) else None
        processed = self._processed(logits, rows, state, token_ids, num_prompt, ends)
        failed: Failures = {}
        if processed is not logits:   # masks ran: a row may have no token left
            for i in np.flatnonzero(np.isneginf(processed.max(axis=1))).tolist():
                failed[i] = NOTHING_LEFT
        logits = processed
        sampled = np.argmax(logits, axis=1)
        random = np.flatnonzero(state.temperature[rows] > 0)
        if failed:
            random = np.setdiff1d(random, list(failed))
        if len(random):
            sampled[random] = self._sample_random(logits[random], rows[random], state,
                                                  num_out[random])
        if failed:
            sampled[list(failed)] = -1
        out_lp = None
        if raw_lp is not None:
            k = int(state.num_logprobs[rows[want_lp]].max())
            chosen = np.maximum(sampled[want_lp], 0)   # failed rows' entries are dropped
            out_lp = SampledLogprobs(want_lp, *top_logprobs(raw_lp, chosen, k))
        return sampled, out_lp, failed

    def processed_logits(self, logits: np.ndarray, rows: np.ndarray, state: SamplingState,
                         token_ids: np.ndarray, num_prompt: np.ndarray, num_tokens: np.ndarray
                         ) -> np.ndarray:
        """Steps 2-3 (masks, bias, penalties) on a copy of logits; what greedy rows argmax.
        With nothing to apply, the logits themselves (no copy)."""
        return self._processed(logits, rows, state, token_ids, num_prompt, num_tokens[rows])

    def _processed(self, logits: np.ndarray, rows: np.ndarray, state: SamplingState,
                   token_ids: np.ndarray, num_prompt: np.ndarray, ends: np.ndarray
                   ) -> np.ndarray:
        if not state.needs_processing(rows):
            return logits
        logits = logits.copy()
        self._apply_masks_and_bias(logits, rows, state, token_ids, num_prompt, ends)
        self._apply_penalties(logits, rows, state, token_ids, num_prompt, ends)
        np.minimum(logits, _F32_MAX, out=logits)   # extreme penalties overflow to +inf
        return logits

    def _apply_masks_and_bias(self, logits: np.ndarray, rows: np.ndarray, state: SamplingState,
                              token_ids: np.ndarray, num_prompt: np.ndarray,
                              ends: np.ndarray) -> None:
        """Per row with list-valued controls, from its precomputed RequestMasks: the ids
        always masked, the bad words' last tokens whose prefix ends the output (one lookup
        per distinct prefix length), the min_tokens stop ids, the bias. No step loops over a
        list's entries in Python; rows sharing params share the masks."""
        vocab = logits.shape[1]
        for i, row in state.rows_with_extras(rows):
            masks = state.masks[row]
            always = masks.always_banned(vocab)
            if len(always):
                logits[i, always] = -np.inf
            if masks.max_prefix:
                start = max(int(num_prompt[row]), int(ends[i]) - masks.max_prefix)
                banned = masks.banned_after(token_ids[row, start:ends[i]].tolist())
                if banned:
                    logits[i, banned] = -np.inf
            if masks.min_tokens_stop_ids is not None and \
                    ends[i] - num_prompt[row] < state.min_tokens[row]:
                logits[i, masks.min_tokens_stop_ids] = -np.inf
            if masks.bias_ids is not None:
                logits[i, masks.bias_ids] += masks.bias_values

    def _apply_penalties(self, logits: np.ndarray, rows: np.ndarray, state: SamplingState,
                         token_ids: np.ndarray, num_prompt: np.ndarray,
                         ends: np.ndarray) -> None:
        which = np.flatnonzero(state.needs_penalties(rows))
        if not len(which):
            return
        r = rows[which]
        vocab = logits.shape[1]
        counts = output_counts(token_ids, r, num_prompt[r], ends[which], vocab).astype(np.float32)
        sub = logits[which]
        rep = state.repetition[r]
        if (rep != 1).any():
            in_prompt = output_counts(token_ids, r, np.zeros_like(r), num_prompt[r], vocab) > 0
            seen = in_prompt | (counts > 0)
            factor = np.where(sub > 0, 1.0 / rep[:, None], rep[:, None]).astype(np.float32)
            with np.errstate(over="ignore"):   # capped at float32's max afterwards
                sub = np.where(seen, sub * factor, sub)
        sub -= state.frequency[r][:, None] * counts
        sub -= state.presence[r][:, None] * (counts > 0)
        logits[which] = sub

    def _sample_random(self, logits: np.ndarray, rows: np.ndarray, state: SamplingState,
                       num_out: np.ndarray) -> np.ndarray:
        """Temperature, then min_p / top_k / top_p as zeroed probabilities, then the
        exponential race over each row's remaining tokens (zero-probability tokens can never
        win it, so drawing noise only for the others changes nothing but the cost)."""
        probs = _softmax(logits, state.temperature[rows][:, None])
        min_p = state.min_p[rows]
        if (min_p > 0).any():
            probs[probs < min_p[:, None] * probs.max(axis=1, keepdims=True)] = 0.0
        top_k = state.top_k[rows]
        for k in np.unique(top_k[(top_k > 0) & (top_k < probs.shape[1])]).tolist():
            sel = np.flatnonzero(top_k == k)
            kth = -np.partition(-probs[sel], k - 1, axis=1)[:, k - 1:k]
            probs[sel] = np.where(probs[sel] < kth, 0.0, probs[sel])
        top_p = state.top_p[rows]
        if (top_p < 1).any():
            sel = np.flatnonzero(top_p < 1)
            probs[sel] = _top_p(probs[sel], top_p[sel])
        return self._race(probs, rows, state, num_out)

    def _race(self, probs: np.ndarray, rows: np.ndarray, state: SamplingState,
              num_out: np.ndarray) -> np.ndarray:
        """argmax(p / q), q ~ Exp(1), over each row's nonzero probabilities."""
        row_idx, cols = np.nonzero(probs)                  # row-major: rows are contiguous
        p = probs[row_idx, cols]
        starts = np.searchsorted(row_idx, np.arange(len(probs)))
        sizes = np.diff(np.append(starts, len(row_idx)))
        noise = np.empty(len(p))
        seeds, seeded = state.seed[rows], state.seeded[rows]
        shared = np.repeat(~seeded, sizes)
        noise[shared] = self.shared_generator.exponential(size=int(shared.sum()))
        for i in np.flatnonzero(seeded).tolist():
            gen = np.random.default_rng((int(seeds[i]), int(num_out[i])))
            noise[starts[i]:starts[i] + sizes[i]] = gen.exponential(size=int(sizes[i]))
        score = p / noise
        best = np.maximum.reduceat(score, starts)
        winners = np.flatnonzero(score == best[row_idx])
        first = winners[np.searchsorted(row_idx[winners], np.arange(len(probs)))]
        return cols[first]


def _softmax(logits: np.ndarray, temperature: np.ndarray | float = 1.0) -> np.ndarray:
    """softmax(logits / temperature) per row; the max is taken out before dividing, so a
    small temperature cannot overflow to inf - inf."""
    with np.errstate(over="ignore"):
        e = np.exp((logits - logits.max(axis=1, keepdims=True)) / temperature)
    e /= e.sum(axis=1, keepdims=True)
    return e


def _stack_logprobs(pieces: list[tuple[int, SampledLogprobs]]) -> SampledLogprobs | None:
    """Per-row SampledLogprobs (row index, its one-row result) as one, top-k lists padded to
    the widest (a request reads only its own first k)."""
    if not pieces:
        return None
    width = max(lp.token_ids.shape[1] for _, lp in pieces)

    def pad(a: np.ndarray, value: float) -> np.ndarray:
        return np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=value)

    return SampledLogprobs(np.array([i for i, _ in pieces], np.int64),
                           np.concatenate([pad(lp.token_ids, 0) for _, lp in pieces]),
                           np.concatenate([pad(lp.logprobs, -np.inf) for _, lp in pieces]),
                           np.concatenate([lp.ranks for _, lp in pieces]))


# top-p first ranks only the tokens at least this likely relative to the best one
_CANDIDATE_RATIO = 1e-3


def _top_p(probs: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """Zero all but, per row, the most likely tokens until their mass reaches top_p of the
    row's (possibly already truncated) total; a token is kept when the mass of strictly more
    likely ones is below that. Rows are first solved from their likeliest candidates only
    (exact once those hold the needed mass: every other token comes after them); the rest
    (flat distributions) are sorted in full."""
    # > 0, so the likeliest token always stays (a top_p that underflowed to 0 keeps it alone)
    need = np.maximum(top_p * probs.sum(axis=1), np.finfo(np.float64).tiny)
    cand = probs >= probs.max(axis=1, keepdims=True) * _CANDIDATE_RATIO
    covered = (probs * cand).sum(axis=1) >= need
    thresholds = np.empty(len(probs))
    done = np.flatnonzero(covered)
    if len(done):
        thresholds[done] = _threshold_from(probs[done], cand[done], need[done])
    flat = np.flatnonzero(~covered)
    if len(flat):
        d = -np.sort(-probs[flat], axis=1)
        before = np.cumsum(d, axis=1) - d
        kept = (before < need[flat, None]).sum(axis=1)
        thresholds[flat] = d[np.arange(len(flat)), kept - 1]
    return np.where(probs < thresholds[:, None], 0.0, probs)


def _threshold_from(probs: np.ndarray, cand: np.ndarray, need: np.ndarray) -> np.ndarray:
    """Per row: the smallest kept probability, ranking only the candidate tokens."""
    rows, cols = np.nonzero(cand)
    p = probs[rows, cols]
    order = np.lexsort((-p, rows))
    rows, p = rows[order], p[order]
    starts = np.searchsorted(rows, np.arange(len(probs)))
    inclusive = np.cumsum(p)
    sizes = np.diff(np.append(starts, len(p)))
    before = inclusive - p - np.repeat(inclusive[starts] - p[starts], sizes)
    return np.minimum.reduceat(np.where(before < need[rows], p, np.inf), starts)
