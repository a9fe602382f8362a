"""The train step's memory knobs: logits made in chunks and micro-batches with summed gradients.

Neither may change a number: chunked log-probs are checked against a numpy log-softmax of the whole
logits, and a micro-batched, chunked TTUR step against docs/algorithms.md §6 written out by hand.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sao_jax import losses
from sao_jax.config import ConfigError, load_config
from sao_jax.models import Critic, Policy, tiny_qwen3_moe
from sao_jax.optim import train_only
from sao_jax.train import steps as steps_lib
from tests.train.test_steps import copy_state, hand_written_ttur, synthetic_batch


def reference_logprobs(logits, tokens):
    """log softmax in float64 numpy, read at the next token; 0 at t = 0."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    tokens = np.asarray(tokens)
    out = np.zeros(tokens.shape)
    for b in range(tokens.shape[0]):
        for t in range(1, tokens.shape[1]):
            out[b, t] = logp[b, t - 1, tokens[b, t]]
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["lm_head", "tied"])
def policy_and_tokens(request):
    policy = Policy(tiny_qwen3_moe(tie_word_embeddings=request.param), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (3, 16), 0, 97)
    mask = jnp.arange(16)[None, :] < jnp.array([[16], [11], [5]])
    return policy, tokens, mask


@pytest.mark.parametrize("chunk", [0, 1, 5, 16, 40])
def test_chunked_logprobs_equal_a_log_softmax_of_the_whole_logits(policy_and_tokens, chunk):
    policy, tokens, mask = policy_and_tokens
    logits = policy(tokens, attention_mask=mask)
    got, aux = policy.token_logprobs(tokens, mask, chunk=chunk)
    np.testing.assert_allclose(got, reference_logprobs(logits, tokens), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(aux, policy.forward(tokens, attention_mask=mask)[2], rtol=1e-6)


@pytest.mark.slow
def test_chunked_logprob_gradients_equal_the_whole_logits_gradients(policy_and_tokens):
    policy, tokens, mask = policy_and_tokens
    graph, params, rest = nnx.split(policy, nnx.Param, ...)
    weights = jax.random.normal(jax.random.key(2), tokens.shape)

    def whole(params):
        logits = nnx.merge(graph, params, rest)(tokens, attention_mask=mask)
        return jnp.sum(weights * losses.token_logprobs(logits, tokens))

    def chunked(params):
        return jnp.sum(weights * nnx.merge(graph, params, rest).token_logprobs(tokens, mask, chunk=5)[0])

    want, got = jax.jit(jax.grad(whole))(params), jax.jit(jax.grad(chunked))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), got, want)


def test_chunked_logprobs_never_hold_the_whole_logits():
    """Compiled scratch memory of the gradient: [2, 256, 8192] float32 logits are 16 MiB."""
    policy = Policy(tiny_qwen3_moe(vocab_size=8192), rngs=nnx.Rngs(0))
    graph, params, rest = nnx.split(policy, nnx.Param, ...)
    tokens = jnp.zeros((2, 256), jnp.int32)

    def scratch_bytes(chunk):
        def loss(params):
            return jnp.sum(nnx.merge(graph, params, rest).token_logprobs(tokens, chunk=chunk)[0])

        return jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes

    whole, chunked = scratch_bytes(0), scratch_bytes(16)
    assert whole > 16 * 2**20
    assert chunked < whole / 4, (whole, chunked)


def test_in_micro_batches_keeps_row_order_and_averages_the_aux_loss():
    tokens = jnp.arange(24).reshape(6, 4)
    mask = jnp.ones((6, 4), bool)

    def forward(tokens, mask):
        return 10 * tokens + mask, jnp.max(tokens).astype(jnp.float32)

    out, aux = steps_lib.in_micro_batches(forward, tokens, mask, 2)
    np.testing.assert_array_equal(out, 10 * tokens + 1)
    # 3 slices of rows {0, 3}, {1, 4}, {2, 5}: maxima 15, 19, 23.
    assert float(aux) == pytest.approx(19.0)
    with pytest.raises(ValueError, match="train.micro_batch_size=4 must divide the batch's 6 rows"):
        steps_lib.in_micro_batches(forward, tokens, mask, 4)


@pytest.mark.slow
def test_a_micro_batched_chunked_ttur_step_equals_the_one_written_out_by_hand():
    """2 micro-batches of 2 rows, logits in chunks of 5 positions. The router aux loss is the mean of
    the micro-batches', not the whole batch's, so this model's coefficient is 0."""
    overrides = ["critic.optimizer.lr=1.0", "policy.optimizer.lr=1.0", "loss.eps_low=0.99",
                 "loss.eps_high=100.0", "train.batch_size=4", "train.micro_batch_size=2", "train.logit_chunk=5"]  # fmt: skip
    config = load_config(None, overrides)
    policy = Policy(tiny_qwen3_moe(router_aux_loss_coef=0.0), rngs=nnx.Rngs(0))
    critic = Critic.from_policy(policy, rngs=nnx.Rngs(1))
    policy_tx = steps_lib.guard_nonfinite(optax.sgd(1.0))
    critic_tx = steps_lib.guard_nonfinite(train_only(optax.sgd(1.0), config.critic.trainable_patterns))
    state, graphs = steps_lib.make_train_state(policy, critic, policy_tx, critic_tx, config, num_prompts=4)
    steps = steps_lib.build_steps(graphs, policy_tx, critic_tx, config)
    batch = synthetic_batch()

    want_critic, want_policy = hand_written_ttur(config, state, graphs, batch, policy_tx, critic_tx)
    new_state, _ = steps.ttur_step(copy_state(state), batch, jax.random.key(0))
    for got, want in ((new_state.critic_params, want_critic), (new_state.policy_params, want_policy)):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), got, want)
    # The knobs are live: the same step with the whole batch at once compiles to a different program.
    whole = dataclasses.replace(config, train=dataclasses.replace(config.train, micro_batch_size=0, logit_chunk=0))
    whole_steps = steps_lib.build_steps(graphs, policy_tx, critic_tx, whole)
    text = steps.ttur_step.lower(state, batch, jax.random.key(0)).as_text()
    assert text != whole_steps.ttur_step.lower(state, batch, jax.random.key(0)).as_text()


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.micro_batch_size=3", "train.micro_batch_size must divide batch_size=32 \\(got 3\\)"),
        ("train.micro_batch_size=-1", "train.micro_batch_size must be >= 0"),
        ("train.logit_chunk=-8", "train.logit_chunk must be >= 0"),
    ],
)
def test_bad_memory_knobs_are_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])
