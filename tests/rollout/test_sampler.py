"""The sampler records log μ and H(μ) of the distribution it actually samples from, and its cached,
chunked decode (with observation prefill in between) gives what one full forward of the whole sequence
gives. References: a jitted uncached full forward of the produced sequence (itself checked against
transformers in tests/models/test_hf_parity.py) and a plain-numpy transform written from the formulas.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.data.tokenizers import CharTokenizer
from sao_jax.models import Policy, tiny_qwen3_moe
from sao_jax.native import decode as native_decode
from sao_jax.rollout.decode import slot_uniforms
from sao_jax.rollout.sampler import Generation, Sampler, entropy_of, sample_from, sampling_log_probs, stop_token_ids

VOCAB = 97
NO_STOP = np.full((3, 2), -1, np.int32)
PREFILL_WIDTH = 8  # every prefill in this module is padded to it: one compiled prefill shape per sampler


# --- independent references --------------------------------------------------------------------------


def reference_log_mu(logits, temperature=1.0, top_k=0, top_p=1.0):
    """log μ of one row, in float64, by ranking tokens one by one (module docstring of sampler.py)."""
    z = np.asarray(logits, np.float64) / temperature
    order = sorted(range(len(z)), key=lambda v: -z[v])
    kept = order[:top_k] if top_k else order
    if top_p < 1.0:
        weights = np.exp(np.array([z[v] for v in kept]) - z[kept[0]])
        probs = weights / weights.sum()
        nucleus, mass = [], 0.0
        for v, p in zip(kept, probs):
            nucleus.append(v)
            mass += p
            if mass >= top_p:
                break
        kept = nucleus
    out = np.full(len(z), -np.inf)
    kept_z = np.array([z[v] for v in kept])
    log_norm = kept_z.max() + np.log(np.sum(np.exp(kept_z - kept_z.max())))
    out[kept] = kept_z - log_norm
    return out


def reference_entropy(log_mu):
    p = np.exp(log_mu)
    return -sum(p[v] * log_mu[v] for v in range(len(log_mu)) if p[v] > 0)


# --- fixtures ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def policy():
    # initializer_range 0.3: peaked next-token distributions, so top-k / top-p cut real mass
    return Policy(tiny_qwen3_moe(vocab_size=VOCAB, initializer_range=0.3), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def params(policy):
    return nnx.state(policy)


@pytest.fixture(scope="module")
def full_logits(policy):
    """Uncached full forward: (ids [batch, time], mask) -> float32 logits [batch, time, vocab]."""
    graphdef, state = nnx.split(policy)
    return jax.jit(lambda ids, mask: nnx.merge(graphdef, state)(ids, attention_mask=mask))


@pytest.fixture(scope="module")
def plain_sampler(policy):
    return Sampler(policy, chunk_size=4)  # small chunks: every generation below spans several


@pytest.fixture(scope="module")
def truncating_sampler(policy):
    return Sampler(policy, temperature=0.7, top_k=12, top_p=0.8, chunk_size=4)


def _padded(rows, width=PREFILL_WIDTH):
    ids, mask = np.zeros((len(rows), width), np.int32), np.zeros((len(rows), width), bool)
    for b, row in enumerate(rows):
        ids[b, : len(row)], mask[b, : len(row)] = row, True
    return ids, mask


def _teacher_forced(full_logits, sequences):
    """Per sequence, float64 logits [len, vocab] of a full forward over the whole sequence."""
    width = max(len(s) for s in sequences)
    ids, mask = _padded(sequences, width)
    logits = np.asarray(full_logits(ids, mask), np.float64)
    return [logits[b, : len(s)] for b, s in enumerate(sequences)]


def _joined(*pieces):
    """One Generation from consecutive Generations of the same rows."""
    lengths = sum(piece.lengths for piece in pieces)
    fields = {}
    for name in ("tokens", "logprobs", "entropy"):
        fields[name] = np.zeros((len(lengths), lengths.max()), getattr(pieces[0], name).dtype)
        for b, n in enumerate(lengths):
            fields[name][b, :n] = np.concatenate([getattr(p, name)[b, : p.lengths[b]] for p in pieces])
    return Generation(lengths=lengths, **fields)


def _check_against_reference(logits_per_seq, starts, generation, **transform):
    """Sampled token t of row b sits at position starts[b] + t and was drawn from logits at the
    position before it: compare the recorded log μ and H(μ) with the numpy reference."""
    for b, start in enumerate(starts):
        for t in range(generation.lengths[b]):
            log_mu = reference_log_mu(logits_per_seq[b][start + t - 1], **transform)
            token = generation.tokens[b, t]
            assert np.isfinite(log_mu[token]), f"row {b} token {t}: sampled {token} outside the kept set"
            np.testing.assert_allclose(generation.logprobs[b, t], log_mu[token], atol=1e-5, err_msg=f"row {b} t {t}")
            np.testing.assert_allclose(generation.entropy[b, t], reference_entropy(log_mu), atol=1e-5,
                                       err_msg=f"row {b} t {t}")  # fmt: skip


# --- the transform alone -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "transform",
    [dict(), dict(temperature=0.5), dict(top_k=1), dict(top_k=7), dict(top_p=0.3), dict(top_p=0.95),
     dict(temperature=1.7, top_k=9, top_p=0.6)],
)  # fmt: skip
def test_sampling_log_probs_match_numpy_transform(transform):
    logits = 3.0 * np.random.default_rng(0).normal(size=(6, 40)).astype(np.float32)
    log_mu = np.asarray(sampling_log_probs(jnp.asarray(logits), **transform))
    entropy = np.asarray(entropy_of(jnp.asarray(log_mu)))
    for b in range(len(logits)):
        expected = reference_log_mu(logits[b], **transform)
        np.testing.assert_array_equal(np.isfinite(log_mu[b]), np.isfinite(expected), err_msg=f"support, row {b}")
        kept = np.isfinite(expected)
        np.testing.assert_allclose(log_mu[b][kept], expected[kept], atol=1e-5)
        np.testing.assert_allclose(entropy[b], reference_entropy(expected), atol=1e-5)


def test_stop_token_ids_of_char_tokenizer():
    tokenizer = CharTokenizer()
    assert stop_token_ids(tokenizer, ["\n"]) == [int(tokenizer.encode("\n")[0])]
    with pytest.raises(ValueError, match="'ab' encodes to 2 tokens"):
        stop_token_ids(tokenizer, ["ab"])


def test_bad_settings_are_named(policy):
    with pytest.raises(ValueError, match="temperature"):
        Sampler(policy, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        Sampler(policy, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        Sampler(policy, top_k=-1)


def test_the_decode_backend_is_one_of_three_names_and_native_cpu_only_on_the_cpu(policy, monkeypatch):
    """"auto" is "native_cpu" on the CPU (these tests' backend) and "xla" elsewhere; an unknown name,
    or "native_cpu" on another backend, is an error naming `decode_backend`."""
    assert Sampler(policy).backend.name == "native_cpu"
    assert Sampler(policy, decode_backend="xla").backend.name == "xla"
    with pytest.raises(ValueError, match=r"^decode_backend must be one of auto, xla, native_cpu \(got 'native'\)"):
        Sampler(policy, decode_backend="native")
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert Sampler(policy).backend.name == "xla"
    with pytest.raises(ValueError, match=r"^decode_backend=native_cpu .* backend here is tpu"):
        Sampler(policy, decode_backend="native_cpu")


# --- the compiled sampler ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native_cpu", "xla", "native_cpu, blocked experts"])
def test_logprobs_equal_full_forward_through_observation_prefill(policy, plain_sampler, params, full_logits,
                                                                 backend):  # fmt: skip
    """Prompts of lengths 3, 7, 1 → decode (a first chunk over an 8-slot window, in which the 7-token
    row pauses after 1 token; then chunks over 64-slot windows of the 96-slot cache) → observations
    of lengths 2, 0, 5 prefilled into the same cache → decode again. Every recorded log-prob and
    entropy equals the log-softmax of one uncached forward over the whole history; the logits after
    the observation equal re-encoding. The same keys with the rows in reverse order, decoded
    without the pause, give the same tokens (a row's draws depend only on its key and positions).
    Both decode backends: "native_cpu" (the attention kernel reads each row's filled slots in the
    whole cache) and "xla" (the einsum over the window's slots, cut from the cache and written back
    after the chunk). With the blocked dispatch (the same weights) every "native_cpu" decode step
    runs the experts' kernel on the weights the sampler packed (`native.decode.pack_experts`); the
    reference stays the sorted dispatch's forward."""
    if backend == "xla":
        plain_sampler = Sampler(policy, chunk_size=4, decode_backend="xla")
    if backend == "native_cpu, blocked experts":
        blocked = Policy(policy.config.replace(moe_dispatch="blocked"), rngs=nnx.Rngs(1))
        nnx.update(blocked, params)
        plain_sampler = Sampler(blocked, chunk_size=4)
        assert len(plain_sampler.backend.prepare(params)) == 1  # the one MoE layer
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, VOCAB, n) for n in (3, 7, 1)]
    budgets = np.array([6, 9, 4])
    keys = jax.random.split(jax.random.key(0), 3)
    state = plain_sampler.init_state(3, 96)
    state = plain_sampler.prefill(params, state, *_padded(prompts))
    state, paused = plain_sampler.decode_chunk(params, state, keys, budgets, NO_STOP, window=8)
    np.testing.assert_array_equal(paused.num_tokens, [4, 1, 4])  # chunk of 4; row 1 reached slot 8
    np.testing.assert_array_equal(paused.finished, [False, False, True])
    state, rest = plain_sampler.generate(params, state, keys, budgets - paused.num_tokens, NO_STOP)
    paused = Generation(tokens=np.asarray(paused.tokens), logprobs=np.asarray(paused.logprobs),
                        entropy=np.asarray(paused.entropy), lengths=np.asarray(paused.num_tokens))  # fmt: skip
    first = _joined(paused, rest)
    np.testing.assert_array_equal(first.lengths, budgets)
    histories = [np.concatenate([p, first.tokens[b, : first.lengths[b]]]) for b, p in enumerate(prompts)]
    _check_against_reference(_teacher_forced(full_logits, histories), [len(p) for p in prompts], first)

    reverse = plain_sampler.prefill(params, plain_sampler.init_state(3, 96), *_padded(prompts[::-1]))
    _, reversed_run = plain_sampler.generate(params, reverse, keys[::-1], budgets[::-1], NO_STOP)
    np.testing.assert_array_equal(reversed_run.tokens[::-1], first.tokens)

    observations = [rng.integers(3, VOCAB, n) for n in (2, 0, 5)]
    state = plain_sampler.prefill(params, state, *_padded(observations))
    histories = [np.concatenate([h, o]) for h, o in zip(histories, observations)]
    np.testing.assert_array_equal(np.asarray(state.cache.lengths), [len(h) for h in histories])
    re_encoded = _teacher_forced(full_logits, histories)
    np.testing.assert_allclose(np.asarray(state.next_logits), np.stack([r[-1] for r in re_encoded]),
                               rtol=1e-5, atol=1e-5)  # fmt: skip

    state, second = plain_sampler.generate(params, state, jax.random.key(1), [5, 5, 7], NO_STOP)
    starts = [len(h) for h in histories]
    histories = [np.concatenate([h, second.tokens[b, : second.lengths[b]]]) for b, h in enumerate(histories)]
    _check_against_reference(_teacher_forced(full_logits, histories), starts, second)


def test_experts_are_packed_once_per_weight_version(policy, params):
    """The "native_cpu" backend packs the experts' weights (`native.decode.pack_experts`) when new
    arrays come in, and reuses the packing for the same arrays (another State over them included);
    "xla" packs nothing."""
    blocked = Policy(policy.config.replace(moe_dispatch="blocked"), rngs=nnx.Rngs(0))
    assert Sampler(blocked, decode_backend="xla").backend.prepare(params) == ()
    backend = Sampler(blocked).backend
    packs = []
    pack = backend._pack
    backend._pack = lambda params: packs.append(1) or pack(params)
    first = backend.prepare(params)
    assert backend.prepare(params) is first and backend.prepare(nnx.state(policy)) is first
    assert len(packs) == 1
    experts = policy.layers[1].mlp.experts
    np.testing.assert_array_equal(np.asarray(first[0]), np.asarray(native_decode.pack_experts(
        experts.gate_proj[...], experts.up_proj[...], experts.down_proj[...])))  # fmt: skip
    newer = jax.tree.map(lambda w: w * 2, params)  # the next published version
    second = backend.prepare(newer)
    assert len(packs) == 2
    np.testing.assert_array_equal(np.asarray(second[0]), 2 * np.asarray(first[0]))
    assert backend.prepare(newer) is second and len(packs) == 2


@pytest.mark.slow
def test_truncated_sampling_records_the_transformed_distribution(truncating_sampler, params, full_logits):
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, VOCAB, n) for n in (5, 2, 8)]
    state = truncating_sampler.init_state(3, 32)
    state = truncating_sampler.prefill(params, state, *_padded(prompts))
    state, generation = truncating_sampler.generate(params, state, jax.random.key(3), [10, 10, 10], NO_STOP)
    histories = [np.concatenate([p, generation.tokens[b, : generation.lengths[b]]]) for b, p in enumerate(prompts)]
    _check_against_reference(_teacher_forced(full_logits, histories), [len(p) for p in prompts], generation,
                             temperature=0.7, top_k=12, top_p=0.8)  # fmt: skip
    assert np.ptp(generation.entropy[:, :10]) > 0.1, "degenerate test: every step had the same distribution"


def test_prefill_takes_the_logits_after_the_last_real_token_wherever_padding_sits(plain_sampler, params, full_logits):
    """Padding on the left, in holes, on the right: each row's cache takes its real tokens and its
    next_logits are those after its last real token in an uncached forward of the real tokens alone."""
    tokens = np.array([[0, 0, 5, 9, 2, 0, 0, 0], [0, 7, 0, 7, 1, 0, 0, 3], [11, 0, 0, 0, 0, 0, 0, 0]], np.int32)
    mask = np.array([[0, 0, 1, 1, 1, 0, 0, 0], [0, 1, 0, 1, 1, 0, 0, 1], [1, 0, 0, 0, 0, 0, 0, 0]], bool)
    state = plain_sampler.prefill(params, plain_sampler.init_state(3, 32), tokens, mask)
    real = [[5, 9, 2], [7, 7, 1, 3], [11]]
    np.testing.assert_array_equal(np.asarray(state.cache.lengths), [3, 4, 1])
    expected = np.stack([logits[-1] for logits in _teacher_forced(full_logits, real)])
    np.testing.assert_allclose(np.asarray(state.next_logits), expected, rtol=1e-5, atol=1e-5)


def test_prefill_reset_starts_a_row_over_while_the_others_continue(plain_sampler, params, full_logits):
    state = plain_sampler.prefill(params, plain_sampler.init_state(3, 32), *_padded([[5, 9, 2], [7, 1], [11]]))
    state = plain_sampler.prefill(params, state, *_padded([[7, 8], [4], []]), reset=[True, False, True])
    np.testing.assert_array_equal(np.asarray(state.cache.lengths), [2, 3, 0])  # row 2: reset, fed nothing
    expected = _teacher_forced(full_logits, [[7, 8], [7, 1, 4]])
    np.testing.assert_allclose(np.asarray(state.next_logits[:2]), np.stack([e[-1] for e in expected]),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_sample_from_draws_by_the_distribution_and_never_outside_its_support():
    """20,000 draws from a fixed μ with zeros (as top-k / top-p leave): frequencies pass a chi-square
    test at 1e-4 significance, and no token with μ = 0 — first, inner or last — is ever drawn."""
    from scipy.stats import chi2

    mu = np.zeros(50)
    mu[[3, 4, 10, 11, 30, 48]] = [0.4, 0.001, 0.2, 0.15, 0.049, 0.2]
    draws = 20_000
    tokens = np.asarray(jax.jit(jax.vmap(sample_from, in_axes=(0, None)))(
        jax.random.uniform(jax.random.key(0), (draws,)), jnp.log(mu)))  # fmt: skip
    support = np.flatnonzero(mu)
    assert tokens.dtype == np.int32 and set(tokens) <= set(support)
    observed = np.array([np.sum(tokens == v) for v in support])
    expected = draws * mu[support]
    assert np.sum((observed - expected) ** 2 / expected) < chi2.ppf(1 - 1e-4, df=len(support) - 1), observed


def test_slot_uniforms_are_jax_randoms_uniform_of_the_folded_key_bit_for_bit():
    """The "native_cpu" backend's slot uniforms (a written-out threefry for JAX's default keys)
    against jax.random.uniform of jax.random.fold_in, one at a time, and against `slot_uniforms`
    (the "xla" backend's), for 500 keys and slots from 0 to 2^31 − 1, jitted, and with
    `jax_threefry_partitionable` off (which changes JAX's bits: the threefry must follow)."""
    keys = jax.random.split(jax.random.key(3), 500)
    slots = np.random.default_rng(3).integers(0, 2**31, 500).astype(np.int32)
    slots[:3] = [0, 1, 2**31 - 1]

    def expected():
        return np.array([jax.random.uniform(jax.random.fold_in(k, s), ()) for k, s in zip(keys[:60], slots[:60])])

    got = np.asarray(jax.jit(native_decode.slot_uniforms)(keys, jnp.asarray(slots)))
    assert got.dtype == np.float32 and 0 <= got.min() and got.max() < 1 and np.ptp(got) > 0.9
    np.testing.assert_array_equal(got[:60], expected())
    np.testing.assert_array_equal(got, np.asarray(jax.jit(slot_uniforms)(keys, jnp.asarray(slots))))
    with jax.threefry_partitionable(False):
        threefry = native_decode.slot_uniforms(keys[:60], jnp.asarray(slots[:60]))
        np.testing.assert_array_equal(np.asarray(threefry), expected())


@pytest.mark.parametrize("vocab", [1000, 77, 32, 5])
def test_sample_from_is_the_inverse_of_the_cumulative_mass(vocab):
    """Each draw is the first v whose float64 cumulative mass reaches u · total, with u = 1 − the
    uniform number, for vocabularies of whole, partial and single blocks with zeros among the
    entries; draws whose u · total lies within 1e-5 of a boundary are not compared (float32 sums)."""
    rng = np.random.default_rng(vocab)
    mu = rng.dirichlet(np.full(vocab, 0.3)) * (rng.random(vocab) < 0.7)
    mu[rng.integers(vocab)] += 0.1
    mu /= mu.sum()
    log_mu = jnp.log(jnp.asarray(mu, jnp.float32))
    uniforms = jax.random.uniform(jax.random.key(vocab), (2000,))
    tokens = np.asarray(jax.jit(jax.vmap(sample_from, in_axes=(0, None)))(uniforms, log_mu))
    u = 1.0 - np.asarray(uniforms, np.float64)
    cumulative = np.cumsum(np.exp(np.asarray(log_mu, np.float64)))
    target = u * cumulative[-1]
    expected = np.searchsorted(cumulative, target)  # first v with cumulative[v] >= target
    clear = np.min(np.abs(cumulative[None, :] - target[:, None]), axis=1) > 1e-5
    assert clear.mean() > 0.9
    np.testing.assert_array_equal(tokens[clear], expected[clear])
    assert set(tokens) <= set(np.flatnonzero(mu))


@pytest.mark.slow
def test_draws_follow_the_recorded_distribution(truncating_sampler, params):
    """512 rows with the same prompt draw their first token independently from one μ: the empirical
    frequencies match exp(recorded log μ) (chi-square, 1e-4 significance) and never leave its support."""
    rows = 512
    state = truncating_sampler.init_state(rows, 8)
    state = truncating_sampler.prefill(params, state, *_padded([[5, 17, 42]] * rows))
    log_mu = np.asarray(truncating_sampler.log_probs(state.next_logits[:1]))[0]
    state, generation = truncating_sampler.generate(params, state, jax.random.key(4), np.ones(rows, np.int32),
                                                    np.full((rows, 1), -1, np.int32))  # fmt: skip
    tokens = generation.tokens[:, 0]
    np.testing.assert_allclose(generation.logprobs[:, 0], log_mu[tokens], atol=1e-6)
    support = np.flatnonzero(np.isfinite(log_mu))
    assert 2 <= len(support) <= 12 and set(tokens) <= set(support)
    expected = rows * np.exp(log_mu[support])
    observed = np.array([np.sum(tokens == v) for v in support])
    chi_square = np.sum((observed - expected) ** 2 / expected)
    from scipy.stats import chi2

    assert chi_square < chi2.ppf(1 - 1e-4, df=len(support) - 1), (observed, expected.round(1))


@pytest.mark.slow
def test_stop_tokens_budgets_and_cache_end_per_row(plain_sampler, params):
    """Row 0 stops on any of 60 token ids, row 1 on none (budget 9), row 2 is idle (budget 0), row 3's
    cache has only 3 free slots. A row ends at its first stop token (kept), at its budget, or when its
    cache is full, across chunk boundaries; the cache grows by exactly the sampled tokens."""
    max_len = 16
    prompts = [[4, 5], [6], [7, 8, 9], list(range(10, 23))]
    state = plain_sampler.init_state(4, max_len)
    ids, mask = _padded(prompts, 16)
    state = plain_sampler.prefill(params, state, ids, mask)
    stop_sets = [np.arange(30, 90), np.array([], int), np.arange(3, 20), np.array([], int)]
    stop_ids = np.full((4, 60), -1, np.int32)
    for b, ids_b in enumerate(stop_sets):
        stop_ids[b, : len(ids_b)] = ids_b
    budgets = [12, 9, 0, 10]
    state, generation = plain_sampler.generate(params, state, jax.random.key(5), budgets, stop_ids)
    lengths = generation.lengths
    assert lengths[1] == 9 and lengths[2] == 0 and lengths[3] == max_len - len(prompts[3])
    row0 = generation.tokens[0, : lengths[0]]
    assert row0[-1] in stop_sets[0], f"row 0 should have stopped on a stop token: {row0}"
    assert not np.isin(row0[:-1], stop_sets[0]).any()
    np.testing.assert_array_equal(np.asarray(state.cache.lengths), [len(p) + n for p, n in zip(prompts, lengths)])
    # a further call on a full cache samples nothing and reports the row finished
    state, chunk = plain_sampler.decode_chunk(params, state, jax.random.split(jax.random.key(6), 4), [0, 0, 0, 5],
                                              stop_ids)  # fmt: skip
    assert int(chunk.num_tokens[3]) == 0 and bool(chunk.finished[3])


@pytest.mark.parametrize("kernel", [False, True])
def test_decode_windows_are_the_next_of_four_sizes_per_octave(plain_sampler, monkeypatch, kernel):
    """64, 80, 96, 112, 128, 160, …: the smallest at least as long as the longest row, capped by the
    cache; the cache length where the decode attention kernel (which reads filled slots only) runs."""
    monkeypatch.setattr(plain_sampler.backend, "attends_filled_slots_only", lambda *args: kernel)
    sizes = sorted({64} | {b + j * b // 4 for b in (2**k for k in range(6, 16)) for j in range(4)})
    state = plain_sampler.init_state(1, 3000)
    for longest in range(1, 3100):
        want = 3000 if kernel else min(3000, next(size for size in sizes if size >= longest))
        assert plain_sampler.window_for(state, longest) == want, longest


def test_a_rows_tokens_depend_only_on_its_key_and_the_slots_they_fill(policy, plain_sampler, params, full_logits):
    """The same rows decoded in chunks of 4 in one batch, and in chunks of 3, in another order, beside
    another row and cut into two `generate` calls, give the same tokens; and each token is the inverse
    CDF of log μ at u = 1 − uniform(fold_in(key, slot)), the slot it takes in the cache."""
    prompts = [[5, 9, 2], [7, 7, 1, 3, 8, 4, 6], [11]]
    keys = jax.random.split(jax.random.key(11), 3)
    state = plain_sampler.prefill(params, plain_sampler.init_state(3, 32), *_padded(prompts))
    _, first = plain_sampler.generate(params, state, keys, [10, 10, 10], NO_STOP)

    other = Sampler(policy, chunk_size=3)
    order = [2, 0, 1]
    rows = [prompts[b] for b in order] + [[3, 3, 3, 3]]
    row_keys = jnp.concatenate([keys[jnp.array(order)], jax.random.split(jax.random.key(12), 1)])
    no_stop = np.full((4, 1), -1, np.int32)
    state = other.prefill(params, other.init_state(4, 32), *_padded(rows))
    state, head = other.generate(params, state, row_keys, [4, 4, 4, 4], no_stop)
    _, tail = other.generate(params, state, row_keys, [6, 6, 6, 6], no_stop)
    second = _joined(head, tail)
    for i, b in enumerate(order):
        np.testing.assert_array_equal(second.tokens[i, :10], first.tokens[b, :10], err_msg=f"row {b}")

    for b, prompt in enumerate(prompts):
        history = np.concatenate([prompt, first.tokens[b, :10]])
        (logits,) = _teacher_forced(full_logits, [history])
        for t in range(10):
            slot = len(prompt) + t
            mu = np.exp(reference_log_mu(logits[slot - 1]))
            u = 1.0 - float(jax.random.uniform(jax.random.fold_in(keys[b], slot), ()))
            expected = int(np.sum(np.cumsum(mu) < u * mu.sum()))
            assert first.tokens[b, t] == expected, f"row {b} token {t}"
