"""Batched sampling from the Policy with a preallocated KV cache: prefill, chunked decode, continuation.

The sampler is a set of pure jitted functions over `(params, DecodeState)`, where `params` is the
state half of `nnx.split(policy)`: new weights can be passed to any call (the rollout engine publishes
versions between decode chunks) without recompiling. `prefill` compiles once per (batch, max_len,
chunk width), `decode_chunk` once per (batch, max_len, window) with windows from `window_for` (four
sizes per octave, or only the cache length where the decode attention kernel runs); the sampling
settings and the decode backend (`sao_jax.rollout.decode`: "xla", or on the CPU "native_cpu") are
fixed per `Sampler`.

The state of a batch of rows (one sequence each) is the KV cache plus, per row, the logits of the next
token given everything fed so far (`next_logits`). Three calls move it forward:

  prefill(params, state, tokens, mask, reset)   feed a chunk of known tokens (a prompt, an observation)
                                               into the cache; rows with no real token are untouched
  decode_chunk(params, state, keys, max_new_tokens, stop_ids, window)
                                               sample up to `chunk_size` tokens per row inside one
                                               `lax.while_loop` (no host sync per token), attending
                                               over the first `window` cache slots only
  generate(...)                                host loop over decode_chunk until every row stopped

A decode step samples token x_t from μ(· | next_logits), records log μ(x_t) and H(μ), feeds x_t into
the cache and keeps the new logits. So a stop token is in the cache when a row stops, and an
observation prefilled afterwards continues the same sequence: the history is never re-encoded.
Randomness is per row: the token that lands in cache slot ℓ of row b is drawn (`sample_from`) at
u = uniform(fold_in(keys[b], ℓ)) (`decode.slot_uniforms`), so a sequence depends only on its own key, not
on its batch neighbours, its row or how decoding was cut into chunks and windows.

What is recorded — μ is the distribution the token is actually drawn from (`sampling_log_probs`;
temperature, then top-k, then top-p, the order of transformers' sampling processors):
  z = logits / temperature
  top-k (top_k > 0):  keep v iff z_v ≥ z_(k), the k-th largest (ties at the threshold are all kept)
  top-p (top_p < 1):  with π = softmax(z) over the kept set, ranked π_(1) ≥ π_(2) ≥ …, keep the
                      smallest prefix 1..r* with Σ_{i≤r*} π_(i) ≥ top_p (ties with π_(r*) kept too)
  log μ_v = z_v − logsumexp_{kept} z   on the kept set, −inf elsewhere
  logprob_t = log μ(x_t)               (the DIS / ESTR behaviour log-prob; with temperature 1 and no
                                        truncation it is the model's own log-softmax)
  entropy_t = −Σ_v μ_v log μ_v          (over the full vocabulary; tokens outside the kept set have
                                        μ_v = 0 and contribute 0)
With temperature ≠ 1 or truncation, log μ is not the model's log-softmax: a ratio π_θ/μ then compares
the trained policy with the transformed sampling distribution (compute π_θ the same way if that is
what is meant).
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from sao_jax.models.layers import KVCache
from sao_jax.rollout import decode


@struct.dataclass
class DecodeState:
    """What the sampler carries between calls for a batch of rows.

    cache        KVCache; `cache.lengths[b]` = tokens of row b fed so far
    next_logits  float32 [batch, vocab]: the model's logits for the next token of each row
                 (undefined for a row that has never been fed)
    """

    cache: KVCache
    next_logits: jax.Array


@struct.dataclass
class DecodeChunk:
    """What one `decode_chunk` produced; each row's tokens are a prefix of the chunk's columns.

    tokens      int32 [batch, chunk]: sampled tokens (0 after the row's `num_tokens`)
    logprobs    float32 [batch, chunk]: log μ(token), μ the sampling distribution (module docstring)
    entropy     float32 [batch, chunk]: full-vocabulary entropy of μ at each sampled token
    num_tokens  int32 [batch]: how many tokens the row sampled in this chunk
    finished    bool [batch]: the row stopped in this chunk (stop token, budget, or cache full);
                False for rows that were not asked to decode
    """

    tokens: jax.Array
    logprobs: jax.Array
    entropy: jax.Array
    num_tokens: jax.Array
    finished: jax.Array


@dataclasses.dataclass
class Generation:
    """Host-side result of `Sampler.generate`: [batch, width] arrays, row b valid for `lengths[b]`."""

    tokens: np.ndarray
    logprobs: np.ndarray
    entropy: np.ndarray
    lengths: np.ndarray


_INVERSION_BLOCK = 32  # entries a block of `sample_from`'s two-level scan sums


def sampling_log_probs(logits: jax.Array, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """log μ [..., vocab] of the distribution sampled from (equations in the module docstring).

    `temperature`, `top_k`, `top_p` are Python numbers: the truncations are left out of the trace
    when off (top_k = 0, top_p = 1).
    """
    z = logits.astype(jnp.float32) / temperature
    if top_k or top_p < 1.0:
        ranked = -jnp.sort(-z, axis=-1)  # descending
        if top_k:
            kth = ranked[..., top_k - 1 : top_k]
            z = jnp.where(z >= kth, z, -jnp.inf)
            ranked = jnp.where(ranked >= kth, ranked, -jnp.inf)
        if top_p < 1.0:
            probs = jax.nn.softmax(ranked, axis=-1)
            mass_before = jnp.cumsum(probs, axis=-1) - probs  # Σ_{i<r} π_(i)
            num_kept = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)  # r*, always >= 1
            threshold = jnp.take_along_axis(ranked, num_kept - 1, axis=-1)
            z = jnp.where(z >= threshold, z, -jnp.inf)
    return jax.nn.log_softmax(z, axis=-1)


def _prefix_sums(x: jax.Array) -> jax.Array:
    """cumsum of a short vector as one masked sum, Σ_{i≤j} x_i for each j (n² terms)."""
    n = x.shape[0]
    return jnp.sum(jnp.where(jnp.arange(n)[:, None] <= jnp.arange(n)[None, :], x[:, None], 0.0), axis=0)


def sample_from(u: jax.Array, log_mu: jax.Array) -> jax.Array:
    """One token (int32) from μ = exp(log_mu) [vocab], by inversion at u ∈ [0, 1): the first v whose
    cumulative mass Σ_{w≤v} μ_w reaches (1 − u) · Σ_w μ_w, so a token with μ_v = 0 is never drawn
    ((1 − u) > 0). One uniform number per token, where `jax.random.categorical` draws a Gumbel variate
    (two logs) for every vocabulary entry.

    The cumulative mass is found in two short prefix sums: over the totals of blocks of
    `_INVERSION_BLOCK` entries, then inside the block that reaches the target. XLA:CPU runs a cumsum
    as a tree of reduce-windows, slow over a whole vocabulary; two short ones written as masked sums
    (`_prefix_sums`, one fusion each) are cheaper still (benchmarks/RESULTS.md). Float rounding can put the
    boundary on an entry of no mass (never seen); the block's likeliest entry is drawn then."""
    mass = jnp.exp(log_mu)
    vocab, size = mass.shape[0], _INVERSION_BLOCK
    blocks = jnp.pad(mass, (0, -vocab % size)).reshape(-1, size)
    ends = _prefix_sums(jnp.sum(blocks, axis=1))  # the mass up to each block's end
    target = (1.0 - u) * ends[-1]
    block = jnp.minimum(jnp.sum(ends < target), blocks.shape[0] - 1)  # the first block to reach it
    start = jnp.where(block > 0, ends[jnp.maximum(block - 1, 0)], 0.0)
    entries = blocks[block]
    inside = jnp.minimum(jnp.sum(start + _prefix_sums(entries) < target), size - 1)
    inside = jnp.where(entries[inside] > 0, inside, jnp.argmax(entries))
    return (block * size + inside).astype(jnp.int32)


def entropy_of(log_probs: jax.Array) -> jax.Array:
    """H = −Σ_v μ_v log μ_v over the last axis; entries with μ_v = 0 (log μ = −inf) contribute 0."""
    return -jnp.sum(jnp.where(jnp.isfinite(log_probs), jnp.exp(log_probs) * log_probs, 0.0), axis=-1)


def stop_token_ids(tokenizer, stop_strings) -> list[int]:
    """Token ids that end an action: each stop string must be exactly one token of `tokenizer`."""
    ids = []
    for stop in stop_strings:
        encoded = [int(i) for i in tokenizer.encode(stop)]
        if len(encoded) != 1:
            raise ValueError(
                f"stop string {stop!r} encodes to {len(encoded)} tokens {encoded}; the sampler stops on single "
                "tokens only"
            )
        ids.append(encoded[0])
    return ids


class Sampler:
    """Jitted prefill / chunked decode for one model graph and one sampling setting.

    Built from a Policy, of which only the structure (graph and config) is kept: every call takes
    `params = nnx.state(policy)` (or `nnx.split(policy)[1]`), so the weights may change between
    calls. `chunk_size`: most tokens one `decode_chunk` samples per row before returning to the host
    (a chunk ends early once every row has stopped or paused).
    The `DecodeState` passed to `prefill` / `decode_chunk` is donated: use only the returned one.

    `decode_backend`, one of `decode.DECODE_BACKENDS`, is what runs the programs' hot operations
    (`sao_jax.rollout.decode`): "xla", the model as written, on any platform; "native_cpu", C++
    kernels for a decode step's attention, projections and experts and a written-out threefry, the
    same numbers several times faster on a few-core CPU, where XLA's own code for these few-row
    steps runs far below the memory bandwidth (benchmarks/RESULTS.md, "Sampler"); "auto" (default),
    "native_cpu" where JAX's default backend is the CPU, else "xla". An unknown name, or
    "native_cpu" off the CPU, is a ValueError naming `decode_backend`. The choice is made here,
    once: the programs pass the backend's kernels to `Policy.forward`.
    """

    def __init__(self, policy, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 chunk_size: int = 32, decode_backend: str = "auto"):  # fmt: skip
        if not temperature > 0:
            raise ValueError(f"Sampler temperature must be > 0 (got {temperature}); for greedy use top_k=1")
        if top_k < 0:
            raise ValueError(f"Sampler top_k must be >= 0, 0 = off (got {top_k})")
        if not 0 < top_p <= 1:
            raise ValueError(f"Sampler top_p must be in (0, 1], 1 = off (got {top_p})")
        if chunk_size < 1:
            raise ValueError(f"Sampler chunk_size must be >= 1 (got {chunk_size})")
        self.graphdef, _ = nnx.split(policy)
        self.config = policy.config
        self.chunk_size = chunk_size
        self.log_probs = functools.partial(sampling_log_probs, temperature=temperature, top_k=top_k, top_p=top_p)
        self.backend = decode.decode_backend(decode_backend, self.graphdef, self.config)
        options = self.backend.compiler_options
        self._prefill = jax.jit(self._prefill_impl, donate_argnums=(2,), compiler_options=options)
        self._decode_chunk = jax.jit(self._decode_chunk_impl, donate_argnums=(2,), static_argnums=(6,),
                                     compiler_options=options)  # fmt: skip

    def init_state(self, batch_size: int, max_len: int) -> DecodeState:
        """An empty state: a zeroed cache of `max_len` slots per row (= the longest sequence)."""
        state = DecodeState(
            cache=KVCache.init(self.config, batch_size, max_len),
            next_logits=jnp.zeros((batch_size, self.config.vocab_size), jnp.float32),
        )
        # One buffer per leaf: KVCache.init may share one zeros array among layers, and a donated
        # argument must not hold the same buffer twice.
        return jax.tree.map(jnp.copy, state)

    def prefill(self, params, state: DecodeState, tokens, mask, reset=None) -> DecodeState:
        """Append a chunk of known tokens to each row's sequence.

        tokens, mask: [batch, time]; row b's real tokens (mask True, in order; padding may sit
        anywhere) are written after its `cache.lengths[b]` tokens. reset: bool [batch] or None; a
        reset row first forgets its sequence (length 0): a new prompt in a reused row.
        A row with at least one real token gets the logits after its last one as `next_logits`.
        """
        tokens = jnp.asarray(tokens, jnp.int32)
        mask = jnp.asarray(mask, bool)
        reset = jnp.zeros(tokens.shape[:1], bool) if reset is None else jnp.asarray(reset, bool)
        return self._prefill(params, self.backend.prepare(params), state, tokens, mask, reset)

    def decode_chunk(self, params, state: DecodeState, keys, max_new_tokens, stop_ids, window: int | None = None):
        """Sample up to `chunk_size` tokens per row; returns (state, DecodeChunk).

        keys: typed PRNG key array [batch] (`jax.random.key`), one per row (module docstring).
        max_new_tokens: int [batch], the most tokens row b may still sample (0: row idle this chunk).
        A row finishes at a stop token, when max_new_tokens are sampled, or when its cache is full.
        stop_ids: int [batch, n_stop], the token ids that end row b's action (the stop token is kept,
        recorded and fed to the cache); pad with -1.
        window: attend over the first `window` cache slots only (default: all). Attention costs
        grow with the slots it reads, so sequences much shorter than the cache decode faster; a row
        that reaches `window` pauses (not finished) and goes on in the next chunk. Use
        `window_for` to pick one of few compiled sizes. Where the decode attention kernel runs
        (`attends_filled_slots_only` of the backend) it reads only the slots each row has filled, so
        the cache is not cut (that would copy it) and the window only pauses rows.
        """
        max_new_tokens = jnp.asarray(max_new_tokens, jnp.int32)
        stop_ids = jnp.asarray(stop_ids, jnp.int32)
        window = state.cache.max_len if window is None else min(int(window), state.cache.max_len)
        return self._decode_chunk(params, self.backend.prepare(params), state, keys, max_new_tokens, stop_ids, window)

    def window_for(self, state: DecodeState, longest: int) -> int:
        """The window a chunk needs when no row is longer than `longest` tokens at its end: the next of
        64, 80, 96, 112, 128, 160, … (four sizes per octave, b·(1 + j/4) for powers of two b ≥ 64),
        at most the cache length. A decode step's einsum attention reads the whole window of K and V,
        so windows finer than powers of two read fewer slots (on average 7/8 as many), for at most 4
        compiled sizes per doubling of the sequence length. Where the decode attention kernel runs,
        which reads only filled slots, the cache length: one compiled size."""
        if self._kernel_attends_filled_slots(state.cache):
            return state.cache.max_len
        longest = max(int(longest), 1)
        octave = max(64, 1 << (longest.bit_length() - 1))  # the power of two b with b ≤ longest < 2b
        quarters = max(0, -(-(longest - octave) * 4 // octave))  # smallest j with b·(1 + j/4) ≥ longest
        return min(state.cache.max_len, octave + quarters * octave // 4)

    def generate(self, params, state: DecodeState, keys, max_new_tokens, stop_ids) -> tuple[DecodeState, Generation]:
        """decode_chunk until every row stopped (one host sync per chunk, each chunk over the window
        its rows need); returns (state, Generation). keys: one PRNG key per row [batch], or a single
        key, split into one per row."""
        if keys.ndim == 0:
            keys = jax.random.split(keys, state.next_logits.shape[0])
        remaining = np.asarray(max_new_tokens, np.int32).copy()
        lengths = np.asarray(jax.device_get(state.cache.lengths))
        rows = [collections.defaultdict(list) for _ in remaining]
        while remaining.any():
            longest = np.max(np.where(remaining > 0, lengths + np.minimum(remaining, self.chunk_size), 0))
            state, chunk = self.decode_chunk(params, state, keys, remaining, stop_ids,
                                             self.window_for(state, longest))  # fmt: skip
            chunk = jax.device_get(chunk)
            for b, row in enumerate(rows):
                for name in ("tokens", "logprobs", "entropy"):
                    row[name].append(getattr(chunk, name)[b, : chunk.num_tokens[b]])
            remaining = np.where(chunk.finished, 0, remaining - chunk.num_tokens)
            lengths = lengths + chunk.num_tokens
        sampled = np.array([sum(len(t) for t in row["tokens"]) for row in rows], np.int32)
        out = {name: np.zeros((len(rows), sampled.max(initial=0)), dtype) for name, dtype in
               (("tokens", np.int32), ("logprobs", np.float32), ("entropy", np.float32))}  # fmt: skip
        for b, row in enumerate(rows):
            for name in out:
                out[name][b, : sampled[b]] = np.concatenate(row[name]) if row[name] else []
        return state, Generation(lengths=sampled, **out)

    # --- jitted implementations -------------------------------------------------------------------

    def _model(self, params, prepared):
        """The policy of `params` and the backend's kernels for it (`prepared`: `backend.prepare`'s)."""
        model = nnx.merge(self.graphdef, params)
        return model, self.backend.kernels(model, prepared)

    def _prefill_impl(self, params, prepared, state: DecodeState, tokens, mask, reset):
        model, kernels = self._model(params, prepared)
        cache = state.cache.replace(lengths=jnp.where(reset, 0, state.cache.lengths))
        logits, cache, _ = model.forward(tokens, attention_mask=mask, cache=cache, kernels=kernels)
        time = tokens.shape[1]
        last_real = time - 1 - jnp.argmax(mask[:, ::-1], axis=1)  # index of each row's last real token
        last_logits = jnp.take_along_axis(logits, last_real[:, None, None], axis=1)[:, 0]
        fed = jnp.any(mask, axis=1)
        return DecodeState(cache=cache, next_logits=jnp.where(fed[:, None], last_logits, state.next_logits))

    def _decode_chunk_impl(self, params, prepared, state: DecodeState, keys, max_new_tokens, stop_ids,
                           window):  # fmt: skip
        model, kernels = self._model(params, prepared)
        batch, chunk = state.next_logits.shape[0], self.chunk_size
        full = state.cache
        budget = jnp.minimum(max_new_tokens, full.max_len - full.lengths)  # a row finishes when it is spent
        within_window = jnp.minimum(budget, window - full.lengths)  # a row pauses when it is spent
        cut = window < full.max_len and not self._kernel_attends_filled_slots(full)
        cache = full.replace(keys=tuple(k[:, :window] for k in full.keys),
                             values=tuple(v[:, :window] for v in full.values)) if cut else full  # fmt: skip
        out = DecodeChunk(
            tokens=jnp.zeros((batch, chunk), jnp.int32),
            logprobs=jnp.zeros((batch, chunk), jnp.float32),
            entropy=jnp.zeros((batch, chunk), jnp.float32),
            num_tokens=jnp.zeros((batch,), jnp.int32),
            finished=(max_new_tokens > 0) & (budget <= 0),  # asked to decode, but the cache is full
        )

        def active(out):
            return ~out.finished & (out.num_tokens < within_window)

        def running(carry):
            step, _, _, out = carry
            return (step < chunk) & jnp.any(active(out))

        def one_token(carry):
            step, cache, next_logits, out = carry
            sampling = active(out)
            log_mu = self.log_probs(next_logits)
            uniforms = self.backend.slot_uniforms(keys, cache.lengths)  # keyed by the slot the token takes
            token = jax.vmap(sample_from)(uniforms, log_mu)
            token = jnp.where(sampling, token, 0)
            logprob = jnp.take_along_axis(log_mu, token[:, None], axis=-1)[:, 0]
            logits, cache, _ = model.forward(token[:, None], attention_mask=sampling[:, None], cache=cache,
                                             kernels=kernels)  # fmt: skip
            next_logits = jnp.where(sampling[:, None], logits[:, 0], next_logits)
            num_tokens = out.num_tokens + sampling
            stopped = jnp.any(token[:, None] == stop_ids, axis=1) | (num_tokens >= budget)
            out = DecodeChunk(
                tokens=out.tokens.at[:, step].set(token),
                logprobs=out.logprobs.at[:, step].set(jnp.where(sampling, logprob, 0.0)),
                entropy=out.entropy.at[:, step].set(jnp.where(sampling, entropy_of(log_mu), 0.0)),
                num_tokens=num_tokens,
                finished=out.finished | (sampling & stopped),
            )
            return step + 1, cache, next_logits, out

        _, cache, next_logits, out = jax.lax.while_loop(
            running, one_token, (jnp.int32(0), cache, state.next_logits, out))  # fmt: skip

        def write_back(full_kv, window_kv):
            return tuple(jax.lax.dynamic_update_slice(f, w, (0, 0, 0, 0)) for f, w in zip(full_kv, window_kv))

        if cut:
            cache = cache.replace(keys=write_back(full.keys, cache.keys), values=write_back(full.values, cache.values))
        return DecodeState(cache=cache, next_logits=next_logits), out

    def _kernel_attends_filled_slots(self, cache: KVCache) -> bool:
        """Whether a decode step runs the attention kernel, which reads only each row's filled slots."""
        return self.backend.attends_filled_slots_only(self.config, cache.keys[0].dtype)
