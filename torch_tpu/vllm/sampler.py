"""vLLM's sampling on tpu in a fixed set of program shapes.

vLLM's Sampler sizes its tensors by the exact request count and by data:
the output tokens padded to the longest output (penalties), one index per
logit bias or stop token, the requested number of logprobs. On tpu every
new size is a new program, compiled mid-traffic. Here every device tensor of
a step has the request bucket's rows (the runner pads the logits to it) and
the vocabulary's width, or a length padded to a power of two:

- each request's parameters (temperature, top-k, top-p, min-p, penalties)
  are uploaded as whole [bucket] tensors with neutral values in the padding
  rows, built on the host from the input batch (no device copy per count);
- logit biases, bad words and min-tokens bans are one list of
  (flat index, value) entries added in one scatter; penalties count the
  prompt's and the output's tokens with one scatter each, over entry lists
  padded to a power of two (padding adds 0 at index 0, or counts into a
  spare slot);
- top-k and top-p run over every row when any request sets one (neutral
  k = vocabulary, p = 1 elsewhere), as vLLM's PyTorch path does;
- logprobs are the top max_logprobs (the model's limit) of every row, cut
  to each request's count on the host.

The results come back to the host whole (the runner reads them there right
after) and are cut to the real requests there. The worker runs every path
once per request bucket before serving (`warm_up`), so no request compiles.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch
from vllm.v1.sample.sampler import Sampler

from torch_tpu.vllm.attention import bucket

_SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy
# Entry lists (biases, bans, penalty counts) are padded to a power of two of at least this.
_MIN_ENTRIES = 64


@dataclasses.dataclass
class HostBatch:
    """A step's sampling parameters on the host, padded to the request bucket."""

    rows: int  # the real requests
    padded: int  # the request bucket
    greedy: np.ndarray | None = None  # [padded] bool; None: every row samples
    temperature: np.ndarray | None = None  # [padded] float32; None: every row is greedy
    top_k: np.ndarray | None = None  # [padded] int64 (vocabulary = off); None: no row sets top-k or top-p
    top_p: np.ndarray | None = None  # [padded] float32 (1 = off)
    min_p: np.ndarray | None = None  # [padded] float32 (0 = off); None: no row sets it
    disallowed: np.ndarray | None = None  # [padded, vocab] bool: allowed_token_ids' complement
    additive: tuple[np.ndarray, np.ndarray] | None = None  # flat indices, values (biases, -inf bans)
    restore: np.ndarray | None = None  # flat indices of stop tokens restored for structured output
    penalties: tuple | None = None  # flat prompt indices, flat output indices, frequency, presence, repetition
    generators: dict = dataclasses.field(default_factory=dict)  # row -> torch.Generator
    logprobs: int | None = None  # most logprobs any request asks (-1: all)

    @property
    def greedy_only(self) -> bool:
        return self.temperature is None


def _pad_entries(index: np.ndarray, value: np.ndarray | None, pad_index: int):
    n = bucket(max(len(index), _MIN_ENTRIES))
    idx = np.full(n, pad_index, dtype=np.int64)
    idx[: len(index)] = index
    if value is None:
        return idx, None
    val = np.zeros(n, dtype=np.float32)
    val[: len(value)] = value
    return idx, val


def _padded(values: np.ndarray, rows: int, fill, dtype) -> np.ndarray:
    out = np.full(rows, fill, dtype=dtype)
    out[: len(values)] = values
    return out


def _flat(rows: list[int], toks: list[int], vocab: int) -> np.ndarray:
    return np.asarray(rows, dtype=np.int64) * vocab + np.asarray(toks, dtype=np.int64)


def _tokens_of(rows, token_lists, vocab: int) -> np.ndarray:
    """Flat (row, token) indices of each row's tokens (repeats kept: counts)."""
    if not rows:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([r * vocab + np.asarray(t, dtype=np.int64) for r, t in zip(rows, token_lists)])


def host_batch(batch, padded: int, vocab: int) -> HostBatch:
    """The sampling parameters of vLLM's InputBatch `batch` (its host-side
    state; the logits processors were built on the CPU) padded to `padded` rows."""
    n = batch.num_reqs
    hb = HostBatch(rows=n, padded=padded, generators=dict(batch.generators), logprobs=batch.max_num_logprobs)
    if not batch.all_greedy:
        temperature = batch.temperature_cpu[:n]
        greedy = temperature < _SAMPLING_EPS
        hb.temperature = _padded(np.where(greedy, 1.0, temperature), padded, 1.0, np.float32)
        hb.greedy = None if batch.all_random else _padded(greedy, padded, True, bool)
        if not (batch.no_top_k and batch.no_top_p):
            hb.top_k = _padded(batch.top_k_cpu[:n], padded, vocab, np.int64)
            hb.top_p = _padded(batch.top_p_cpu[:n], padded, 1.0, np.float32)
    entries, values = [], []
    for proc in batch.logitsprocs.all:
        if isinstance(proc, MinPLogitsProcessor) and proc.min_p_count and hb.temperature is not None:
            hb.min_p = _padded(proc.min_p_cpu[:n], padded, 0.0, np.float32)
        elif isinstance(proc, LogitBiasLogitsProcessor) and proc.biases:
            rows, toks = proc.logits_slice
            entries.append(_flat(rows.tolist(), toks.tolist(), vocab))
            values.append(proc.bias_tensor.numpy())
        elif isinstance(proc, MinTokensLogitsProcessor) and proc.min_toks:
            rows, toks = proc.logits_slice
            entries.append(_flat(rows.tolist(), toks.tolist(), vocab))
            values.append(np.full(len(entries[-1]), -np.inf, dtype=np.float32))
            if proc.restore_logits_slice[0].numel():
                hb.restore = _flat(*(t.tolist() for t in proc.restore_logits_slice), vocab)
    outputs = batch.req_output_token_ids
    for row, words in batch.bad_words_token_ids.items():
        past = outputs[row]
        for word in words:
            prefix = word[:-1]
            if len(prefix) <= len(past) and (not prefix or past[-len(prefix):] == prefix):
                entries.append(np.array([row * vocab + word[-1]], dtype=np.int64))
                values.append(np.array([-np.inf], dtype=np.float32))
    if entries:
        hb.additive = (np.concatenate(entries), np.concatenate(values))
    if not batch.no_allowed_token_ids:
        mask = np.zeros((padded, vocab), dtype=bool)
        mask[:n] = batch.allowed_token_ids_mask_cpu_tensor[:n, :vocab].numpy()
        hb.disallowed = mask
    if not batch.no_penalties:
        frequency = batch.frequency_penalties_cpu[:n]
        presence = batch.presence_penalties_cpu[:n]
        repetition = batch.repetition_penalties_cpu[:n]
        rows = [i for i in range(n) if frequency[i] or presence[i] or repetition[i] != 1.0]
        prompt = _tokens_of(rows, [batch.token_ids_cpu[i, : batch.num_prompt_tokens[i]] for i in rows], vocab)
        output = _tokens_of(rows, [outputs[i] for i in rows], vocab)
        hb.penalties = (prompt, output, _padded(frequency, padded, 0.0, np.float32),
                        _padded(presence, padded, 0.0, np.float32), _padded(repetition, padded, 1.0, np.float32))
    return hb


def grammar_rows(grammar_output, batch, rows: int) -> np.ndarray:
    """The structured-output bitmask (xgrammar's: bit j of word w allows
    token 32 w + j) of each of the step's `rows` rows, in the batch's order;
    rows without a grammar allow every token."""
    bitmask = grammar_output.grammar_bitmask
    out = np.full((rows, bitmask.shape[1]), -1, dtype=np.int32)
    for j, req_id in enumerate(grammar_output.structured_output_request_ids):
        row = batch.req_id_to_index.get(req_id)
        if row is not None:
            out[row] = bitmask[j]
    return out


def apply_grammar(logits: torch.Tensor, rows: np.ndarray) -> None:
    """Masks, in place, the tokens the rows' grammars forbid: the bitmask is
    unpacked on the device, one program per request bucket (xgrammar's own
    kernel takes a list of the structured rows: a program per count)."""
    device = logits.device
    words = torch.from_numpy(rows).to(device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words[:, :, None] >> shifts) & 1).reshape(rows.shape[0], -1)[:, : logits.shape[1]]
    logits.masked_fill_(allowed == 0, float("-inf"))


def grammar_bitmask_on_tpu(apply_grammar_bitmask):
    """vLLM's apply_grammar_bitmask, with apply_grammar for tpu logits
    (without speculative tokens: a row per request)."""

    def apply(scheduler_output, grammar_output, batch, logits):
        if logits.device.type != "tpu" or scheduler_output.scheduled_spec_decode_tokens:
            return apply_grammar_bitmask(scheduler_output, grammar_output, batch, logits)
        apply_grammar(logits, grammar_rows(grammar_output, batch, logits.shape[0]))

    return apply


class TpuSampler(Sampler):
    """vLLM's Sampler over logits of the request bucket's rows and a HostBatch."""

    def __init__(self, logprobs_mode, max_logprobs: int):
        super().__init__(logprobs_mode)
        self.max_logprobs = max_logprobs

    def _counts(self, flat: np.ndarray, rows: int, vocab: int, device) -> torch.Tensor:
        """[rows, vocab] counts of the flat (row, token) indices."""
        size = rows * vocab
        idx, _ = _pad_entries(flat, None, size)  # padding counts into the spare slot
        counts = torch.zeros(size + 1, dtype=torch.float32, device=device)
        counts.index_put_((torch.from_numpy(idx).to(device),), torch.ones(len(idx), device=device), accumulate=True)
        return counts[:size].view(rows, vocab)

    def _penalize(self, logits: torch.Tensor, hb: HostBatch) -> torch.Tensor:
        prompt, output, frequency, presence, repetition = hb.penalties
        rows, vocab = logits.shape
        device = logits.device
        prompt_mask = self._counts(prompt, rows, vocab, device) > 0
        output_counts = self._counts(output, rows, vocab, device)
        output_mask = output_counts > 0
        up = lambda a: torch.from_numpy(a).to(device)[:, None]  # noqa: E731
        penalty = torch.where(prompt_mask | output_mask, up(repetition), 1.0)
        logits = logits * torch.where(logits > 0, 1.0 / penalty, penalty)
        return logits - up(frequency) * output_counts - up(presence) * output_mask

    def _process(self, logits: torch.Tensor, hb: HostBatch) -> torch.Tensor:
        """vLLM's order: allowed ids, bad words, biases and min-tokens, penalties."""
        device = logits.device
        if hb.disallowed is not None:
            logits = logits.masked_fill(torch.from_numpy(hb.disallowed).to(device), float("-inf"))
        if hb.additive is not None:
            stops = None
            if hb.restore is not None:
                restore, _ = _pad_entries(hb.restore, None, 0)
                restore = torch.from_numpy(restore).to(device)
                stops = logits.reshape(-1)[restore]
            idx, val = _pad_entries(*hb.additive, 0)
            flat = logits.reshape(-1)
            flat.index_put_((torch.from_numpy(idx).to(device),), torch.from_numpy(val).to(device), accumulate=True)
            logits = flat.view(logits.shape)
            if stops is not None:
                # Min-tokens with structured output: a row left with no token
                # gets its stop tokens back (vLLM's MinTokensLogitsProcessor).
                dead = torch.isneginf(logits).all(dim=-1)
                real = torch.arange(len(restore), device=device) < len(hb.restore)
                back = dead[restore // logits.shape[1]] & torch.isfinite(stops) & real
                flat = logits.reshape(-1)
                flat.index_put_((restore,), torch.where(back, stops, flat[restore]))
                logits = flat.view(logits.shape)
        if hb.penalties is not None:
            logits = self._penalize(logits, hb)
        return logits

    def _sample_rows(self, logits: torch.Tensor, hb: HostBatch) -> torch.Tensor:
        device = logits.device
        greedy = logits.argmax(dim=-1) if hb.greedy is not None or hb.greedy_only else None
        if hb.greedy_only:
            return greedy
        up = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
        logits = logits / up(hb.temperature)[:, None]
        if hb.min_p is not None:
            probs = logits.softmax(dim=-1)
            floor = probs.amax(dim=-1, keepdim=True) * up(hb.min_p)[:, None]
            logits = logits.masked_fill(probs < floor, float("-inf"))
        if hb.top_k is not None:
            logits = apply_top_k_top_p_pytorch(logits, up(hb.top_k), up(hb.top_p))
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        noise = torch.empty_like(probs).exponential_()
        if hb.generators:
            # A seeded request's noise comes from its own generator, a row of
            # the vocabulary's size as vLLM draws it; rows are put in place by
            # one index_copy over a padded list (padding goes to a spare row).
            rows = sorted(hb.generators)
            count = bucket(len(rows))
            seeded = [torch.empty(probs.shape[1], device=device).exponential_(generator=hb.generators[r]) for r in rows]
            seeded += [torch.ones(probs.shape[1], device=device)] * (count - len(rows))
            target = torch.from_numpy(_padded(np.array(rows), count, hb.padded, np.int64)).to(device)
            spare = torch.cat([noise, torch.ones(1, probs.shape[1], device=device)])
            spare.index_copy_(0, target, torch.stack(seeded))
            noise = spare[: hb.padded]
        sampled = (probs / noise).argmax(dim=-1)
        if greedy is not None:
            sampled = torch.where(up(hb.greedy), greedy, sampled)
        return sampled

    def top_logprobs(self, scores: torch.Tensor, tokens: torch.Tensor):
        """On the host, uncut: per row, [token, top max_logprobs] ids and
        logprobs, and the token's rank (vLLM's gather_logprobs at the most
        logprobs any request may ask; each request's own count is cut on the
        host, so one program serves every count)."""
        k = min(self.max_logprobs, scores.shape[1])
        top = scores.topk(k, dim=-1)
        token = scores.gather(-1, tokens[:, None])
        ranks = (scores >= token).sum(-1)
        ids = torch.cat((tokens[:, None], top.indices), dim=1).to(torch.int32)
        return ids.cpu(), torch.cat((token, top.values), dim=1).cpu(), ranks.cpu()

    def _logprobs(self, raw: torch.Tensor, sampled: torch.Tensor, hb: HostBatch) -> LogprobsTensors:
        if hb.logprobs == -1:
            return LogprobsTensors(torch.empty(0), raw.cpu()[: hb.rows], torch.empty(0))
        ids, values, ranks = self.top_logprobs(raw, sampled)
        keep = hb.logprobs + 1
        return LogprobsTensors(ids[: hb.rows, :keep], values[: hb.rows, :keep], ranks[: hb.rows])

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """What logprobs report, per the logprobs mode (raw_logprobs or raw_logits)."""
        logits = logits.to(torch.float32)
        return logits.log_softmax(dim=-1) if self.logprobs_mode == "raw_logprobs" else logits.clone()

    def sample_batch(self, logits: torch.Tensor, hb: HostBatch, logprob_token_ids=None) -> SamplerOutput:
        """Samples the padded rows of `logits`; the results (on the host) have
        the real requests' rows."""
        # Contiguous: the vocabulary may be a slice of a padded one, and the
        # scatters below write through a flat view.
        logits = logits.to(torch.float32).contiguous()
        raw = None
        if hb.logprobs is not None or logprob_token_ids:
            raw = self.scores(logits)
        sampled = self._sample_rows(self._process(logits, hb), hb)
        logprobs = None
        if logprob_token_ids:
            # Scoring given tokens (a rare request): on the host, vLLM's own code.
            logprobs = self.gather_specific_token_logprobs(raw.cpu()[: hb.rows], logprob_token_ids,
                                                           sampled.cpu()[: hb.rows])
        elif hb.logprobs is not None:
            logprobs = self._logprobs(raw, sampled, hb)
        tokens = sampled.cpu()[: hb.rows].to(torch.int32)
        return SamplerOutput(sampled_token_ids=tokens.unsqueeze(-1), logprobs_tensors=logprobs)

    def warm_up(self, logits: torch.Tensor, vocab: int, max_entries: int, generator: torch.Generator) -> int:
        """Runs every path once for logits of this request bucket: greedy
        alone, and sampling with every parameter at once (the ops of each
        parameter depend on the bucket only, not on which others run), then
        the entry-list scatters at every padded length up to max_entries.
        Returns the paths run."""
        rows = logits.shape[0]
        ones = np.ones(rows, dtype=np.float32)
        entries = np.arange(rows, dtype=np.int64) * vocab
        self.sample_batch(logits, HostBatch(rows=rows, padded=rows))
        every = HostBatch(
            rows=rows, padded=rows, greedy=np.arange(rows) % 2 == 0, temperature=ones,
            top_k=np.full(rows, vocab, dtype=np.int64), top_p=ones, min_p=np.zeros(rows, dtype=np.float32),
            disallowed=np.zeros((rows, vocab), dtype=bool),
            additive=(entries, np.zeros(rows, dtype=np.float32)), restore=entries,
            penalties=(entries, entries, ones * 0, ones * 0, ones), generators={0: generator},
            logprobs=1,
        )
        self.sample_batch(logits, every)
        self.sample_batch(logits, dataclasses.replace(every, greedy=None))  # every row sampled
        apply_grammar(logits, np.full((rows, -(-vocab // 32)), -1, dtype=np.int32))  # allows every token
        paths, n = 4, _MIN_ENTRIES * 2
        while n <= bucket(max_entries):
            entries = np.zeros(n, dtype=np.int64)
            self._process(logits.to(torch.float32).contiguous(), dataclasses.replace(
                every, disallowed=None, additive=(entries, np.zeros(n, dtype=np.float32)), restore=entries,
                penalties=(entries, entries, ones * 0, ones * 0, ones)))
            paths, n = paths + 1, n * 2
        # Seeded requests: their noise rows are stacked per padded count.
        for count in range(2, rows + 1):
            if bucket(count) == count:
                self._sample_rows(logits.to(torch.float32).contiguous(), dataclasses.replace(
                    every, generators={r: generator for r in range(count)}))
                paths += 1
        return paths
