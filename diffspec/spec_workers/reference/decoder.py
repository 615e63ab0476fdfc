"""The reference decoder: engine-free, one request at a time, clarity first.

Design notes: docs/design/reference.md (section ``diffspec/spec_workers/reference/decoder.py``).
"""

from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from torch import Tensor

from diffspec.core.accept import (
    AcceptOutput,
    coupled_accept,
    greedy_accept,
    rejection_sample_accept,
    truncate_at_stop,
)
from diffspec.core.kv import rollback_kv
from diffspec.core.sampling import (
    SamplingParams,
    coupled_sample,
    position_gumbel_noise,
    probs_from_logits,
    process_logits,
    sample_from_probs,
)

__all__ = [
    "BlockDrafter",
    "DraftModel",
    "Drafter",
    "LookupDrafter",
    "NgramDrafter",
    "Request",
    "RequestOutput",
    "ar_generate",
    "sample_drafts",
    "speculative_generate",
]

AcceptMode = Literal["auto", "greedy", "coupled", "rejection"]


@dataclass
class Request:
    """One generation request. ``stop_token_ids`` usually holds the EOS ids; stop strings are
    matched on the decoded output (``skip_special_tokens=True``) and need a tokenizer."""

    prompt_token_ids: list[int]  # [prompt_len]
    max_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        self.stop_strings = tuple(self.stop_strings)
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if any(t < 0 for t in self.prompt_token_ids):
            raise ValueError("prompt_token_ids must be >= 0")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(self.sampling)}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop_strings must be non-empty strings")

    def check_fits(self, max_len: int, vocab_size: int) -> None:
        """Raise ``ValueError`` unless prompt + max_tokens fits the model's context."""
        total = len(self.prompt_token_ids) + self.max_tokens
        if total > max_len:
            raise ValueError(
                f"prompt ({len(self.prompt_token_ids)} tokens) + max_tokens ({self.max_tokens}) "
                f"= {total} exceeds the model's context length (max_position_embeddings = "
                f"{max_len})"
            )
        if max(self.prompt_token_ids) >= vocab_size:
            raise ValueError(f"prompt_token_ids must be < vocab_size ({vocab_size})")


@dataclass
class RequestOutput:
    """What a request produced, and how many forwards it took."""

    token_ids: list[int] = field(default_factory=list)  # [num_generated], stop token included
    finish_reason: Literal["stop", "length"] | None = None
    num_forwards: int = 0  # model calls after the prefill (see the module docstring)
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per step
    num_draft_tokens: int = 0  # drafts proposed and verified, in all
    num_accepted_tokens: int = 0  # drafts the accept rule passed, before stop / length cuts
    num_lookup_steps: int = 0  # steps whose drafts came from prompt lookup (LookupDrafter)

    @property
    def tpf(self) -> float:
        """Tokens per forward (generated tokens / forwards after prefill)."""
        return len(self.token_ids) / max(1, self.num_forwards)

    @property
    def mean_accept_length(self) -> float:
        """Mean tokens emitted per step (accepted drafts + the recovered / bonus token)."""
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    @property
    def acceptance_histogram(self) -> list[int]:
        """``hist[k]`` = number of steps that emitted ``k`` tokens."""
        counts = Counter(self.accept_lengths)
        return [counts.get(k, 0) for k in range(max(counts, default=0) + 1)]


class Drafter(Protocol):
    """Proposes up to ``num_tokens`` draft tokens after ``token_ids`` (prompt + generated).

    Returns the draft ids and, optionally, their draft probabilities ``[n, vocab]`` (``None``
    means point-mass drafts). ``forwards_per_propose`` is the number of neural forwards one
    call costs (0 for a lookup). Keyword arguments (a drafter may ignore them):

    * ``cache``: the request's ``DynamicCache``, holding the KV of ``token_ids[:-1]`` (the
      anchor ``token_ids[-1]`` is not in it); it must be left at that length;
    * ``sampling``: the request's :class:`SamplingParams`;
    * ``generator``: the ``torch.Generator`` of rejection sampling (``None`` otherwise).

    A drafter trained for a bounded block may set ``max_draft_tokens``;
    :func:`speculative_generate` then refuses a larger ``num_draft_tokens``."""

    forwards_per_propose: int

    def propose(
        self,
        token_ids: list[int],
        num_tokens: int,
        *,
        cache=None,
        sampling: SamplingParams | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[list[int], Tensor | None]:
        ...


@dataclass
class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the last ``n`` tokens
    (``n = n_max`` down to ``n_min``) and propose the tokens that followed it."""

    n_max: int = 3
    n_min: int = 1
    forwards_per_propose: int = field(default=0, init=False, repr=False)  # a lookup

    def __post_init__(self) -> None:
        if not 1 <= self.n_min <= self.n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={self.n_min} n_max={self.n_max}")

    def propose(self, token_ids: list[int], num_tokens: int,
                **_: object) -> tuple[list[int], Tensor | None]:
        if num_tokens <= 0:
            return [], None
        length = len(token_ids)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            suffix = token_ids[length - n :]
            for start in range(length - n - 1, -1, -1):  # most recent earlier occurrence
                if token_ids[start : start + n] == suffix:
                    return token_ids[start + n : start + n + num_tokens], None
        return [], None


class LookupDrafter:
    """Prompt lookup first (:func:`~diffspec.core.lookup.lookup_drafts`: the continuation
    of the context's longest earlier n-gram match, no forward), ``drafter`` where the
    context holds no match: the engines' rule at a fixed draft count, so an engine's
    steps can be checked against this decoder's one for one. Lookup drafts are point
    masses; ``looked_up`` and ``forwards_per_propose`` describe the last proposal."""

    def __init__(self, drafter: Drafter, settings=None) -> None:
        from diffspec.core.lookup import PromptLookup

        self.drafter = drafter
        self.settings = settings or PromptLookup()
        self.looked_up = False
        self.forwards_per_propose = getattr(drafter, "forwards_per_propose", 0)

    @property
    def max_draft_tokens(self) -> int | None:
        return getattr(self.drafter, "max_draft_tokens", None)

    def propose(self, token_ids: list[int], num_tokens: int,
                **context: object) -> tuple[list[int], Tensor | None]:
        from diffspec.core.lookup import lookup_drafts

        found = lookup_drafts([token_ids], [num_tokens], self.settings)[0] if num_tokens > 0 \
            else []
        self.looked_up = bool(found)
        if found:
            self.forwards_per_propose = 0
            return found, None
        self.forwards_per_propose = getattr(self.drafter, "forwards_per_propose", 0)
        return self.drafter.propose(token_ids, num_tokens,
                                    **(context if _takes_context(self.drafter) else {}))


def sample_drafts(
    logits: Tensor,  # [n, vocab] draft logits; row i predicts sequence index first_position + i
    sampling: SamplingParams,
    first_position: int,
    generator: torch.Generator | None = None,
    *,
    point_mass: bool = False,
) -> tuple[list[int], Tensor | None]:  # draft ids [n], draft probs [n, vocab] or None
    """Draft tokens from draft logits, under the request's sampling parameters.

    * greedy: the argmax (point-mass drafts);
    * seeded, verified by coupled acceptance (``generator is None``): the coupled sample
      with the verifier's own noise, ``position_gumbel_noise(seed, [position])``, so a draft
      is accepted whenever the drafter's processed logits and the target's agree on the
      perturbed argmax; the output stays exactly seeded AR (point-mass drafts);
    * otherwise (unseeded, or rejection sampling with a generator): ``d ~ q`` with
      ``q = probs_from_logits(logits)``, drawn from ``generator``, and ``q`` is returned so
      that rejection sampling accepts with ``min(1, p / q)``.

    ``point_mass=True`` (sample-and-match) draws sampled drafts ``d ~ q`` independently of
    the verifier's noise (from ``generator``, or for seeded requests from a generator keyed
    on ``(seed, first_position)``) and returns no ``q``: the verifier then accepts ``d`` when
    the AR sample equals it (coupled acceptance), or with probability ``p(d)`` (point-mass
    rejection sampling, the same thing in distribution).
    """
    if logits.shape[0] == 0:
        return [], None
    if sampling.is_greedy:
        return logits.argmax(dim=-1).tolist(), None
    processed = process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    coupled = sampling.seed is not None and generator is None
    if coupled and not point_mass:
        positions = list(range(first_position, first_position + logits.shape[0]))
        noise = position_gumbel_noise(sampling.seed, positions, logits.shape[-1]).to(logits.device)
        return coupled_sample(processed, noise).tolist(), None
    q = torch.softmax(processed, dim=-1)  # [n, vocab]
    if coupled:  # sample-and-match on a seeded request: its own reproducible draws
        generator = torch.Generator(device=q.device).manual_seed(
            (sampling.seed * 1_000_003 + first_position) % 2**63)
    drafts = sample_from_probs(q, generator).tolist()
    return drafts, None if point_mass else q


class DraftModel(Protocol):
    """A self-speculative model: one block-view forward gives the logits of its drafts."""

    block_size: int  # K: the anchor + at most K - 1 drafts per block

    def draft_logits(self, anchor: int, cache, num_drafts: int) -> Tensor:  # [n, vocab]
        ...


class BlockDrafter:
    """Drafts with one forward of a :class:`DraftModel` on the request's KV cache, then
    :func:`sample_drafts`. The Orthrus and NLD drafters (:mod:`diffspec.spec_workers`) are
    this with their model; ``point_mass`` selects sample-and-match drafting."""

    forwards_per_propose = 1
    point_mass = False

    def __init__(self, model: DraftModel) -> None:
        self.model = model

    @property
    def max_draft_tokens(self) -> int:
        return self.model.block_size - 1

    @torch.inference_mode()
    def propose(
        self,
        token_ids: list[int],  # [committed]; token_ids[-1] is the anchor
        num_tokens: int,
        *,
        cache=None,  # DynamicCache with the KV of token_ids[:-1]
        sampling: SamplingParams | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[list[int], Tensor | None]:  # drafts [n], draft probs [n, vocab] or None
        if num_tokens <= 0:
            return [], None
        name = type(self).__name__
        if cache is None:
            raise ValueError(f"{name} drafts on the request's KV cache; pass cache=")
        if cache.get_seq_length() != len(token_ids) - 1:
            raise ValueError(f"{name}: the KV cache holds {cache.get_seq_length()} tokens, "
                             f"expected {len(token_ids) - 1} (every committed token but the "
                             f"anchor)")
        logits = self.model.draft_logits(token_ids[-1], cache, num_tokens)  # [n, vocab]
        return sample_drafts(logits, sampling or SamplingParams(), len(token_ids), generator,
                             point_mass=self.point_mass)


# ------------------------------------------------------------------------ shared machinery


@dataclass
class _Run:
    """One request in flight: committed tokens, the KV cache of all but the anchor."""

    request: Request
    token_ids: list[int]  # [prompt_len + num_generated]; token_ids[-1] is the anchor
    cache: object  # DynamicCache holding the KV of token_ids[:-1]
    output: RequestOutput

    @property
    def remaining(self) -> int:
        return self.request.max_tokens - len(self.output.token_ids)


@torch.inference_mode()
def _forward(model, cache, token_ids: list[int]) -> Tensor:  # -> [len(token_ids), vocab]
    """One causal forward of ``token_ids`` on top of ``cache`` (which it extends)."""
    start = cache.get_seq_length()
    input_ids = torch.tensor([token_ids], device=model.device)  # [1, S]
    position_ids = torch.arange(start, start + len(token_ids), device=model.device)[None]
    out = model(input_ids=input_ids, past_key_values=cache, position_ids=position_ids,
                use_cache=True)
    return out.logits[0].float()


def start_request(model, request: Request) -> _Run:
    """Validate ``request`` against the model and prefill all prompt tokens but the anchor."""
    from transformers import DynamicCache

    request.check_fits(model.config.max_position_embeddings, model.config.vocab_size)
    cache = DynamicCache(config=model.config)
    if len(request.prompt_token_ids) > 1:
        _forward(model, cache, request.prompt_token_ids[:-1])  # prefill: not counted
    return _Run(request, list(request.prompt_token_ids), cache, RequestOutput())


def _hits_stop_string(run: _Run, tokenizer, new_tokens: list[int]) -> int | None:
    """How many of ``new_tokens`` to keep if one completes a stop string, else ``None``."""
    if not run.request.stop_strings:
        return None
    if tokenizer is None:
        raise ValueError("stop_strings need a tokenizer (pass tokenizer=...)")
    for i in range(len(new_tokens)):
        ids = run.output.token_ids + new_tokens[: i + 1]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if any(s in text for s in run.request.stop_strings):
            return i + 1
    return None


def commit_tokens(run: _Run, emitted: list[int], tokenizer) -> None:
    """Append the emitted tokens, cut at max_tokens, a stop token or a stop string."""
    emitted = emitted[: run.remaining]
    keep = truncate_at_stop(emitted, run.request.stop_token_ids)
    stopped = any(t in run.request.stop_token_ids for t in emitted[:keep])
    by_string = _hits_stop_string(run, tokenizer, emitted[:keep])
    if by_string is not None:
        keep, stopped = by_string, True
    emitted = emitted[:keep]
    run.token_ids += emitted
    run.output.token_ids += emitted
    run.output.accept_lengths.append(len(emitted))
    if stopped:
        run.output.finish_reason = "stop"
    elif run.remaining == 0:
        run.output.finish_reason = "length"


def _sample(logits: Tensor, params: SamplingParams, position: int, generator) -> int:
    """The AR rule for one position: ``logits`` [vocab] predicts sequence index ``position``."""
    if params.is_greedy:
        return int(logits.argmax())
    processed = process_logits(logits[None], params.temperature, params.top_k, params.top_p)
    if params.seed is None:
        return int(sample_from_probs(torch.softmax(processed, -1), generator)[0])
    noise = position_gumbel_noise(params.seed, [position], logits.shape[-1]).to(logits.device)
    return int(coupled_sample(processed, noise)[0])


# ------------------------------------------------------------------------------ decoders


def ar_generate(model, requests: list[Request], tokenizer=None) -> list[RequestOutput]:
    """Plain autoregressive decoding, one token per forward (the oracle)."""
    outputs = []
    for request in requests:
        run = start_request(model, request)
        while run.output.finish_reason is None:
            logits = _forward(model, run.cache, run.token_ids[-1:])  # [1, vocab]
            run.output.num_forwards += 1
            token = _sample(logits[0], request.sampling, len(run.token_ids), None)
            commit_tokens(run, [token], tokenizer)
        outputs.append(run.output)
    return outputs


def _takes_context(drafter: Drafter) -> bool:
    """Whether ``drafter.propose`` accepts the keyword arguments (older two-argument drafters
    keep working)."""
    params = inspect.signature(drafter.propose).parameters.values()
    return any(p.kind == p.VAR_KEYWORD or p.name == "cache" for p in params)


def accept_mode(request: Request, accept: AcceptMode) -> str:
    params = request.sampling
    if accept == "auto":
        if params.is_greedy:
            return "greedy"
        return "coupled" if params.seed is not None else "rejection"
    if accept == "greedy" and not params.is_greedy:
        raise ValueError("accept='greedy' needs a greedy request (temperature 0)")
    if accept == "coupled" and params.seed is None and not params.is_greedy:
        raise ValueError("accept='coupled' needs a seeded request (SamplingParams.seed)")
    if accept not in ("greedy", "coupled", "rejection"):
        raise ValueError(f"accept must be auto, greedy, coupled or rejection, got {accept!r}")
    return accept


def accept_drafts(
    mode: str,
    params: SamplingParams,
    drafts: list[int],  # [n]
    draft_probs: Tensor | None,  # [n, vocab] or None
    logits: Tensor,  # [n + 1, vocab] raw target logits of [anchor, d_1 .. d_n]
    first_position: int,  # sequence index that logits[0] predicts
    generator: torch.Generator | None,
) -> AcceptOutput:
    draft_ids = torch.tensor([drafts], dtype=torch.long, device=logits.device)  # [1, n]
    if mode == "greedy":
        return greedy_accept(draft_ids, logits[None])
    if mode == "coupled":
        processed = process_logits(logits, params.temperature, params.top_k, params.top_p)
        positions = range(first_position, first_position + len(drafts) + 1)
        noise = position_gumbel_noise(params.seed, list(positions), logits.shape[-1])
        return coupled_accept(draft_ids, processed[None], noise[None].to(logits.device))
    q = None if draft_probs is None else draft_probs[None].to(logits.device)  # [1, n, vocab]
    return rejection_sample_accept(draft_ids, q, probs_from_logits(logits, params)[None],
                                   generators=generator)


def speculative_generate(
    model,
    drafter: Drafter,
    requests: list[Request],
    num_draft_tokens: int,
    accept: AcceptMode = "auto",
    tokenizer=None,
) -> list[RequestOutput]:
    """Speculative decoding: draft -> verify -> accept -> commit, until a stop.

    ``accept="auto"`` uses greedy acceptance for greedy requests, coupled acceptance for
    seeded sampled requests (equal to :func:`ar_generate` token for token) and rejection
    sampling for unseeded ones; ``"rejection"`` forces rejection sampling (seeded from the
    request's seed when it has one: equal to AR in distribution, not token for token).
    """
    if num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
    limit = getattr(drafter, "max_draft_tokens", None)
    if limit is not None and num_draft_tokens > limit:
        raise ValueError(f"num_draft_tokens={num_draft_tokens} exceeds what the drafter was "
                         f"trained for: at most {limit} drafts per step (block_size - 1)")
    max_len = model.config.max_position_embeddings
    with_context = _takes_context(drafter)
    outputs = []
    for request in requests:
        mode = accept_mode(request, accept)
        generator = None
        if mode == "rejection" and request.sampling.seed is not None:
            generator = torch.Generator(device=model.device).manual_seed(request.sampling.seed)
        run = start_request(model, request)
        while run.output.finish_reason is None:
            committed = len(run.token_ids)  # the anchor is token committed - 1
            # Never draft past max_tokens (accepted + 1 <= remaining) or the context.
            n = min(num_draft_tokens, run.remaining - 1, max_len - committed)

            # draft
            context = dict(cache=run.cache, sampling=request.sampling, generator=generator)
            drafts, draft_probs = (
                drafter.propose(run.token_ids, n, **(context if with_context else {}))
                if n > 0 else ([], None)
            )
            if run.cache.get_seq_length() != committed - 1:
                raise RuntimeError("the drafter left the KV cache at another length; it must roll "
                                   "back whatever it appends")
            drafts = list(drafts[:n])
            draft_probs = None if draft_probs is None else draft_probs[: len(drafts)]
            # (read after the proposal: a LookupDrafter's cost depends on its source)
            run.output.num_forwards += getattr(drafter, "forwards_per_propose", 0) if n > 0 else 0
            run.output.num_lookup_steps += bool(n > 0 and getattr(drafter, "looked_up", False))

            # verify: one causal forward over [anchor, d_1 .. d_n]
            logits = _forward(model, run.cache, [run.token_ids[-1], *drafts])  # [n + 1, vocab]
            run.output.num_forwards += 1

            # accept
            result = accept_drafts(mode, request.sampling, drafts, draft_probs, logits,
                             committed, generator)
            emitted = result.tokens(0)
            run.output.num_draft_tokens += len(drafts)
            run.output.num_accepted_tokens += int(result.num_accepted[0])

            # commit: the last emitted token becomes the anchor, outside the cache
            commit_tokens(run, emitted, tokenizer)
            rollback_kv(run.cache, len(run.token_ids) - 1)
        outputs.append(run.output)
    return outputs


# ---------------------------------------------------------------- decoder factories
# The registry (diffspec.methods) names these as the reference decoder of "ar" / "ngram";
# each method file has its own ``decoder(info, options)``.


def load_tokenizer(info):
    """The checkpoint's own tokenizer (local files only, no remote code)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(info.path), trust_remote_code=False)


def load_ar_view(info, dtype: torch.dtype = torch.float32):
    """The plain causal LM of any checkpoint diffspec reads: the family's AR view
    (registry ``Family.ar_view``, e.g. Orthrus without its diffusion heads) or a stock
    transformers causal LM."""
    from diffspec.methods import FAMILIES, load_object

    family = FAMILIES.get(info.family)
    if family is not None and family.ar_view is not None:
        return load_object(family.ar_view)(info.path, dtype)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(info.path), dtype=dtype).eval()


def stop_token_ids(eos: tuple[int, ...], model, tokenizer) -> tuple[int, ...]:
    """``eos`` (the checkpoint's), then the generation config's and the tokenizer's EOS."""
    ids = list(eos)
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += list(gen_eos) if isinstance(gen_eos, (list, tuple)) else (
        [] if gen_eos is None else [gen_eos])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def causal_decoder(method: str, info, model, decode, options, eos: tuple[int, ...] = ()):
    """A :class:`~diffspec.spec_workers.reference.Decoder` around a causal LM ``model``."""
    from diffspec.spec_workers.reference import Decoder

    tokenizer = load_tokenizer(info)
    return Decoder(method, tokenizer, lambda requests: decode(requests, tokenizer),
                   stop_token_ids(eos or info.eos_token_ids, model, tokenizer),
                   model.config.max_position_embeddings, model.config.vocab_size, options)


def draft_count(info, options) -> int:
    """``options["num_draft_tokens"]``, else what the checkpoint's block allows; checked
    against the trained block (a clear error when it is larger)."""
    from diffspec.core.checkpoint import max_block_tokens, validate_block_size

    k = options.get("num_draft_tokens")
    if k is None:
        k = max_block_tokens(info)
    if k is None or isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_draft_tokens must be an int >= 1, got {k!r}")
    validate_block_size(info, k)
    return k


def speculative_decoder(method: str, info, options, load):
    """A speculative :class:`~diffspec.spec_workers.reference.Decoder` for a self-speculative
    method: check the checkpoint serves ``method`` and the draft count fits its block, then
    ``load(dtype) -> (model, drafter)`` (``model.lm`` verifies, ``drafter`` drafts)."""
    from diffspec.core.checkpoint import require_method

    require_method(info, method)
    k = draft_count(info, options)
    model, drafter = load(options.get("dtype", torch.float32))
    return causal_decoder(
        method, info, model.lm,
        lambda requests, tok: speculative_generate(model.lm, drafter, requests, k, tokenizer=tok),
        {**options, "num_draft_tokens": k}, model.eos_token_ids)


def ar_decoder(info, options):
    """Plain AR decoding of any causal checkpoint (the lossless oracle)."""
    model = load_ar_view(info, options.get("dtype", torch.float32))
    return causal_decoder("ar", info, model,
                          lambda requests, tok: ar_generate(model, requests, tok), options)


def ngram_decoder(info, options):
    """Prompt-lookup (n-gram) speculation on any causal checkpoint."""
    model = load_ar_view(info, options.get("dtype", torch.float32))
    k = options["num_draft_tokens"]  # registry default: 8
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_draft_tokens must be an int >= 1, got {k!r}")
    drafter = NgramDrafter()
    return causal_decoder(
        "ngram", info, model,
        lambda requests, tok: speculative_generate(model, drafter, requests, k, tokenizer=tok),
        options)
