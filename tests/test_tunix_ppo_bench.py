"""benchmarks/tunix_ppo.py on a tiny model (d_model 32, 1 layer, 16 tokens): both Tunix updates run,
their first losses equal the PPO losses recomputed in numpy from the mini-batch, and a second call
sees updated weights. Also pins a Tunix 0.1.x behaviour the benchmark works around: the PPO learner
truncates fractional rewards to the dtype of the token ids."""

import importlib.util
import pathlib
import types

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("tunix.rl.ppo.ppo_learner")
from tunix.rl.ppo import ppo_learner  # noqa: E402

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "tunix_ppo.py"
_spec = importlib.util.spec_from_file_location("tunix_ppo_bench", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

TINY = dict(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64, vocab=64)
BATCH, SEQ, PROMPT_LEN = 3, 16, 4


def masked_mean(x, mask):
    return float(np.sum(np.asarray(x, np.float64) * mask) / np.sum(mask))


@pytest.fixture(scope="module")
def run():
    """Two calls of each update of `make_tunix_updates`, and the mini-batch they train on, rebuilt by
    `make_tunix_setup` from the same seed (~20 s on a loaded machine: small compiles)."""
    _, example = bench.make_tunix_setup(batch=BATCH, seq=SEQ, prompt_len=PROMPT_LEN, **TINY)
    calls = bench.make_tunix_updates(batch=BATCH, seq=SEQ, prompt_len=PROMPT_LEN, **TINY)
    assert set(calls) == {bench.ACTOR_UPDATE, bench.CRITIC_UPDATE}
    first = {name: call() for name, call in calls.items()}
    second = {name: call() for name, call in calls.items()}
    return example, first, second


@pytest.mark.slow
def test_train_example_is_laid_out_like_a_tunix_rollout(run):
    example = run[0]
    prompt_ids, completion_ids = np.asarray(example.prompt_ids), np.asarray(example.completion_ids)
    completion_mask = np.asarray(example.completion_mask)
    assert prompt_ids.shape == (BATCH, PROMPT_LEN) and completion_ids.shape == (BATCH, SEQ - PROMPT_LEN)
    for prompt, completion, mask in zip(prompt_ids, completion_ids, completion_mask):
        real = np.flatnonzero(prompt != bench.PAD_ID)
        assert real.size >= 1 and real[-1] == PROMPT_LEN - 1 and np.all(np.diff(real) == 1)  # left-padded
        length = int(mask.sum())
        assert np.all(mask[:length]) and not np.any(mask[length:])  # right-padded
        assert completion[length - 1] == bench.EOS_ID and bench.EOS_ID not in completion[: length - 1]
    assert np.all(np.asarray(example.old_values)[~completion_mask] == 0)
    for array in (example.advantages, example.returns, example.old_per_token_logps):
        assert np.all(np.isfinite(np.asarray(array)))


@pytest.mark.slow
def test_first_actor_update_loss_is_the_clipped_surrogate_at_ratio_one(run):
    """Old log-probs come from the same weights, so ratio = 1 and the loss is −mean(A) over the
    completion tokens, with nothing clipped."""
    example, first, _ = run
    loss, aux, grad_norm = first[bench.ACTOR_UPDATE]
    mask = np.asarray(example.completion_mask)
    np.testing.assert_allclose(float(loss), -masked_mean(example.advantages, mask), atol=1e-5)
    assert float(aux["pg_clipfrac"]) == 0.0
    assert np.isfinite(float(grad_norm)) and float(grad_norm) > 0


@pytest.mark.slow
def test_first_critic_update_loss_is_half_the_mean_squared_error_to_the_returns(run):
    """Old values come from the same weights, so the clipped prediction is the prediction and the
    loss is ½ · mean((V_old − R)²) over the completion tokens."""
    example, first, _ = run
    loss, aux, grad_norm = first[bench.CRITIC_UPDATE]
    mask = np.asarray(example.completion_mask)
    squared_error = (np.asarray(example.old_values, np.float64) - np.asarray(example.returns, np.float64)) ** 2
    np.testing.assert_allclose(float(loss), 0.5 * masked_mean(squared_error, mask), rtol=1e-5)
    np.testing.assert_allclose(float(aux["vpred_mean"]), masked_mean(example.old_values, mask), rtol=1e-5, atol=1e-6)
    assert np.isfinite(float(grad_norm)) and float(grad_norm) > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", [bench.ACTOR_UPDATE, bench.CRITIC_UPDATE])
def test_each_call_is_a_real_update(run, name):
    _, first, second = run
    assert np.isfinite(float(second[name][0]))
    assert float(second[name][0]) != float(first[name][0])  # the weights moved between the calls


@pytest.mark.parametrize("tie_embeddings, num_experts", [(True, None), (False, None), (False, 4)])
def test_flop_count_covers_every_tunix_matmul_parameter(tie_embeddings, num_experts):
    """The matmul parameters behind the FLOP count plus the parts that do no matmul (input embedding
    when untied, RMSNorm weights) add up to Tunix's own parameter count, all experts active."""
    config = bench.tunix_qwen3_config(
        **TINY, tie_embeddings=tie_embeddings, num_experts=num_experts, num_experts_per_token=num_experts or 2
    )
    d, dh, layers, vocab = TINY["d_model"], TINY["head_dim"], TINY["num_layers"], TINY["vocab"]
    norms = layers * (2 * d + 2 * dh) + d  # two per layer, q and k norms, the final norm
    input_embedding = 0 if tie_embeddings else vocab * d
    counts = bench.tunix_param_counts(config)
    flops = bench.tunix_update_flops(config, batch=1, seq=1)
    attention = 12 * layers * TINY["num_heads"] * dh  # per token at seq = 1
    actor_matmul = (flops[bench.ACTOR_UPDATE] - attention) / 6
    critic_matmul = (flops[bench.CRITIC_UPDATE] - attention) / 6
    assert counts["actor"] == actor_matmul + input_embedding + norms
    unused_by_critic = vocab * d * (1 if tie_embeddings else 2)  # the embedding (a gather), the LM head
    assert counts["critic"] == critic_matmul + unused_by_critic + norms
    assert counts["critic"] == counts["actor"] + d  # Qwen3 plus the value head


def test_issue_reference_model_has_13_6m_parameters():
    assert round(bench.tunix_param_counts(bench.tunix_qwen3_config(**bench.D512_SIZES))["actor"] / 1e5) == 136


class _StubCluster:
    """The parts of an RLCluster that `PPOLearner._generate_and_compute_advantage` reads, for two
    prompts of 2 tokens and completions of 3 and 2 tokens (the last EOS), values and log-probs 0."""

    def __init__(self):
        self.cluster_config = types.SimpleNamespace(
            rollout_config=types.SimpleNamespace(max_tokens_to_generate=4)
        )
        self.rollout = types.SimpleNamespace(pad_id=lambda: 0, eos_id=lambda: 1)

    def generate(self, prompts, micro_batch_size):
        del micro_batch_size
        return types.SimpleNamespace(
            tokens=[np.array([5, 6, 1]), np.array([7, 1])],
            left_padded_prompt_tokens=np.array([[0, 3], [3, 4]]),
            text=[f"completion of {p}" for p in prompts],
        )

    def get_old_per_token_logps(self, prompt_tokens, completion_tokens, micro_batch_size):
        return jnp.zeros(completion_tokens.shape, jnp.float32)

    def get_values(self, prompt_tokens, completion_tokens, pad_id, eos_id):
        return jnp.zeros((prompt_tokens.shape[0], prompt_tokens.shape[1] + completion_tokens.shape[1]), jnp.float32)

    def buffer_metrics(self, metrics, mode):
        pass


def test_tunix_ppo_learner_truncates_fractional_rewards_to_the_token_id_dtype():
    """Tunix 0.1.6, tunix/rl/ppo/ppo_learner.py, `PPOLearner._generate_and_compute_advantage`:
    `rewards = jnp.zeros_like(jax_completion_ids)` (int32) `.at[rows, eos_idx].add(scores)`, so a
    score of 0.7 becomes 0 and 1.5 becomes 1 (JAX warns that the cast is unsafe). With zero values
    and discount γ = 1, the return at the EOS token is the reward itself, so it shows the truncation.
    The method runs unbound on a stand-in learner: only the cluster's model calls are stubbed."""
    scores = np.array([0.7, 1.5], np.float32)
    learner = types.SimpleNamespace(
        rl_cluster=_StubCluster(), algo_config=ppo_learner.PPOConfig(beta=0.0, gamma=1.0), _use_reward_model=False,
        _compute_rewards=lambda prompts, completions, mode, **_: scores, _rollout_micro_batch_size=None,
        _compute_logps_micro_batch_size=None, metric_fns=[],
    )  # fmt: skip
    with pytest.warns(FutureWarning, match="cannot safely cast"):
        example = ppo_learner.PPOLearner._generate_and_compute_advantage(learner, {"prompts": ["p0", "p1"]})
    eos_index = [2, 1]
    returns_at_eos = np.asarray(example.returns)[np.arange(2), eos_index]
    np.testing.assert_array_equal(returns_at_eos, np.trunc(scores))  # [0, 1], not [0.7, 1.5]
