"""The training steps: TTUR composition checked against the same sequence written out by hand."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sao_jax import advantages as adv
from sao_jax import losses
from sao_jax.config import load_config
from sao_jax.models import Critic, Policy, tiny_qwen3_moe
from sao_jax.optim import adamw, label_params, param_paths, train_only
from sao_jax.rollout.trajectory import Trajectory, collate
from sao_jax.train import steps as steps_lib
from sao_jax.train.build import make_optimizers
from sao_jax.train.warm_start import value_pretraining_update

K = 2


def synthetic_batch(seed=0, rows=4, vocab=97):
    """Rows of prompt ‖ a0 ‖ o0 ‖ a1 with random lengths, outcome reward on the last action token."""
    rng = np.random.default_rng(seed)
    trajectories = []
    for row in range(rows):
        lengths = rng.integers(2, 6, size=4)
        kinds = np.repeat([0, 1, 2, 1], lengths)  # 0 prompt, 1 action, 2 observation
        n = len(kinds)
        action = kinds == 1
        rewards = np.zeros(n, np.float32)
        rewards[np.flatnonzero(action)[-1]] = float(rng.integers(0, 2))
        trajectories.append(
            Trajectory(
                tokens=rng.integers(3, vocab, size=n).astype(np.int32),
                action_mask=action,
                rollout_logprobs=np.where(action, rng.normal(-2.0, 0.3, n), 0).astype(np.float32),
                rollout_entropy=np.where(action, rng.uniform(0.5, 2.0, n), 0).astype(np.float32),
                policy_version=np.where(action, 0, -1).astype(np.int32),
                rewards=rewards,
                turn_index=np.zeros(n, np.int32),
                prompt_id=row,
            )
        )
    return jax.tree.map(jnp.asarray, collate(trajectories, buckets=(32,)))


@pytest.fixture(scope="module")
def setup():
    return make_setup()


def make_setup(*overrides):
    config = load_config(None, ["critic.optimizer.lr=1.0", "policy.optimizer.lr=1.0", "loss.eps_low=0.99",
                                "loss.eps_high=100.0", *overrides])  # fmt: skip
    model_config = tiny_qwen3_moe()
    policy = Policy(model_config, rngs=nnx.Rngs(0))
    critic = Critic.from_policy(policy, rngs=nnx.Rngs(1), value_bins=config.critic.value_bins_or_scalar)
    # SGD, not Adam: Adam's first step is ±lr for any gradient, which would amplify float32
    # reassociation noise in near-zero gradients past any sensible tolerance.
    policy_tx = steps_lib.guard_nonfinite(optax.sgd(config.policy.optimizer.lr))
    critic_tx = steps_lib.guard_nonfinite(
        train_only(optax.sgd(config.critic.optimizer.lr), config.critic.trainable_patterns)
    )
    state, graphs = steps_lib.make_train_state(policy, critic, policy_tx, critic_tx, config, num_prompts=4)
    steps = steps_lib.build_steps(graphs, policy_tx, critic_tx, config)
    return config, state, graphs, steps, policy_tx, critic_tx


def copy_state(state):
    return jax.tree.map(jnp.copy, state)


def hand_written_ttur(config, state, graphs, batch, policy_tx, critic_tx, **settings):
    """docs/algorithms.md §6 spelled out: K critic steps on λ_critic targets, then values from the updated
    critic, λ_policy advantages and one DIS step — without the composition helpers. Jitted as a whole:
    one compile instead of dispatching every operation of three backward passes one by one.
    settings: `gamma`, `lam_critic`, `lam_policy` (None: length-adaptive with α = 1.5), `policy`
    (False: the critic's K steps only); the defaults are the default config's."""
    written_out = functools.partial(_hand_written_ttur, config, graphs=graphs, policy_tx=policy_tx,
                                    critic_tx=critic_tx, **settings)  # fmt: skip
    return jax.jit(written_out)(state, batch)


def _hand_written_ttur(config, state, batch, *, graphs, policy_tx, critic_tx, gamma=1.0, lam_critic=1.0,
                       lam_policy=None, policy=True, value_clip_eps=None, kl_coef=0.0, histogram=None):  # fmt: skip
    critic_params, critic_opt = state.critic_params, state.critic_opt_state

    def critic_forward(params):
        model = nnx.merge(graphs.critic, params, state.critic_buffers)
        raw, _, aux = model.forward(batch.tokens, attention_mask=batch.valid_mask)
        return jnp.concatenate([jnp.zeros_like(raw[:, :1]), raw[:, :-1]], axis=1), aux

    # PPO's value clipping: around the values of the critic before the step's K updates.
    clip = {} if value_clip_eps is None else {"old_values": critic_forward(critic_params)[0], "clip_eps": value_clip_eps}
    for _ in range(K):
        def value_objective(params):
            values, aux = critic_forward(params)
            if histogram is not None:  # (bin edges, σ): the head's logits, V their histogram's mean
                logits, values = values, losses.hl_gauss_values(values, histogram[0])
            _, targets = adv.skip_observation_gae(
                batch.rewards, jax.lax.stop_gradient(values), batch.action_mask, gamma=gamma, lam=lam_critic
            )
            if histogram is not None:
                loss = losses.hl_gauss_value_loss(logits, targets, batch.action_mask, edges=histogram[0],
                                                  sigma=histogram[1])[0]  # fmt: skip
            else:
                loss = losses.value_loss(values, targets, batch.action_mask, **clip)[0]
            return loss + graphs.critic_aux_coef * aux

        grads = jax.grad(value_objective)(critic_params)
        updates, critic_opt = critic_tx.update(grads, critic_opt, critic_params)
        critic_params = optax.apply_updates(critic_params, updates)
    if not policy:
        return critic_params, state.policy_params

    values, _ = critic_forward(critic_params)
    if lam_policy is None:
        lam_policy = 1.0 - 1.0 / (1.5 * jnp.sum(batch.action_mask, axis=1))
    advantages, _ = adv.skip_observation_gae(batch.rewards, values, batch.action_mask, gamma=gamma, lam=lam_policy)

    def token_logp(params):
        model = nnx.merge(graphs.policy, params, state.policy_buffers)
        logits, _, aux = model.forward(batch.tokens, attention_mask=batch.valid_mask)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        logp = jnp.take_along_axis(logp, batch.tokens[:, 1:, None], axis=-1)[..., 0]
        return jnp.concatenate([jnp.zeros_like(logp[:, :1]), logp], axis=1), aux

    def policy_objective(params):
        logp, aux = token_logp(params)
        ratio = jnp.exp(logp - batch.rollout_logprobs)
        keep = (ratio > 1 - config.loss.eps_low) & (ratio < 1 + config.loss.eps_high) & batch.action_mask
        keep = jax.lax.stop_gradient(keep)
        n = jnp.sum(batch.action_mask)
        objective = -jnp.sum(jnp.where(keep, ratio * advantages, 0.0)) / n + graphs.policy_aux_coef * aux
        if kl_coef:  # k3 toward the frozen reference, over every action token
            delta = jnp.where(batch.action_mask, token_logp(state.reference_params)[0] - logp, 0.0)
            objective += kl_coef * jnp.sum(jnp.where(batch.action_mask, jnp.exp(delta) - delta - 1, 0.0)) / n
        return objective

    grads = jax.grad(policy_objective)(state.policy_params)
    updates, policy_opt = policy_tx.update(grads, state.policy_opt_state, state.policy_params)
    policy_params = optax.apply_updates(state.policy_params, updates)
    return critic_params, policy_params


def assert_params_close(got, want):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), got, want)


def test_ttur_step_equals_the_sequence_written_out_by_hand(setup):
    config, state, graphs, steps, policy_tx, critic_tx = setup
    batch = synthetic_batch()
    expected_critic, expected_policy = hand_written_ttur(config, state, graphs, batch, policy_tx, critic_tx)
    new_state, metrics = steps.ttur_step(copy_state(state), batch, jax.random.key(0))
    assert_params_close(new_state.critic_params, expected_critic)
    assert_params_close(new_state.policy_params, expected_policy)
    assert int(new_state.step) == 1
    assert {"critic/value_loss", "critic/explained_variance", "policy/loss", "policy/masked_fraction",
            "policy/masked_entropy_mean"} <= set(metrics)  # fmt: skip


def test_ttur_step_takes_gamma_and_both_lambdas_from_the_config(setup):
    """γ < 1, λ_critic < 1 and a fixed λ_policy (no length adaptation): the defaults (all 1, or α)
    would hide a γ or λ that never reaches its GAE."""
    _, state, graphs, _, policy_tx, critic_tx = setup
    config = load_config(None, ["critic.optimizer.lr=1.0", "policy.optimizer.lr=1.0", "loss.eps_low=0.99",
                                "loss.eps_high=100.0", "advantage.gamma=0.9", "advantage.lam_critic=0.7",
                                "advantage.lam_policy=0.8", "advantage.length_adaptive_alpha=null"])  # fmt: skip
    steps = steps_lib.build_steps(graphs, policy_tx, critic_tx, config)
    batch = synthetic_batch(seed=5)
    expected_critic, expected_policy = hand_written_ttur(config, state, graphs, batch, policy_tx, critic_tx,
                                                         gamma=0.9, lam_critic=0.7, lam_policy=0.8)  # fmt: skip
    new_state, _ = steps.ttur_step(copy_state(state), batch, jax.random.key(0))
    assert_params_close(new_state.critic_params, expected_critic)
    assert_params_close(new_state.policy_params, expected_policy)


def test_value_clip_eps_clips_the_k_critic_updates_around_the_critic_before_them(setup):
    _, state, graphs, _, policy_tx, critic_tx = setup
    config = load_config(None, ["critic.optimizer.lr=1.0", "policy.optimizer.lr=1.0", "loss.eps_low=0.99",
                                "loss.eps_high=100.0", "loss.value_clip_eps=0.002"])  # fmt: skip
    steps = steps_lib.build_steps(graphs, policy_tx, critic_tx, config)
    batch = synthetic_batch(seed=7)
    clipped, _ = hand_written_ttur(config, state, graphs, batch, policy_tx, critic_tx, policy=False,
                                   value_clip_eps=0.002)  # fmt: skip
    unclipped, _ = hand_written_ttur(config, state, graphs, batch, policy_tx, critic_tx, policy=False)
    new_state, metrics = steps.critic_warmup_step(copy_state(state), batch, jax.random.key(0))
    assert_params_close(new_state.critic_params, clipped)
    gaps = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), clipped, unclipped))
    assert max(gaps) > 1e-3  # the clip binds on the second update
    assert float(metrics["critic/clip_fraction"]) > 0


def test_kl_coef_adds_the_k3_penalty_toward_the_frozen_reference(setup):
    _, state, graphs, _, policy_tx, critic_tx = setup
    config = load_config(None, ["critic.optimizer.lr=1.0", "policy.optimizer.lr=1.0", "loss.eps_low=0.99",
                                "loss.eps_high=100.0", "loss.kl_coef=0.5"])  # fmt: skip
    assert state.reference_params is None  # the default config keeps no reference
    # A reference away from the policy, so the penalty and its gradient are not zero.
    noise = jax.tree.map(lambda x: 0.3 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), state.policy_params)
    start = copy_state(state).replace(reference_params=jax.tree.map(jnp.add, state.policy_params, noise))
    steps = steps_lib.build_steps(graphs, policy_tx, critic_tx, config)
    batch = synthetic_batch(seed=8)
    _, penalised = hand_written_ttur(config, start, graphs, batch, policy_tx, critic_tx, kl_coef=0.5)
    _, plain = hand_written_ttur(config, start, graphs, batch, policy_tx, critic_tx)
    new_state, metrics = steps.ttur_step(copy_state(start), batch, jax.random.key(0))
    assert_params_close(new_state.policy_params, penalised)
    gaps = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), penalised, plain))
    assert max(gaps) > 1e-3
    assert float(metrics["policy/kl_to_reference"]) > 0
    jax.tree.map(np.testing.assert_array_equal, new_state.reference_params, start.reference_params)


def test_critic_warmup_step_is_k_critic_updates_and_leaves_the_policy(setup):
    config, state, graphs, steps, policy_tx, critic_tx = setup
    batch = synthetic_batch(seed=6)
    expected_critic, _ = hand_written_ttur(config, state, graphs, batch, policy_tx, critic_tx, policy=False)
    new_state, metrics = steps.critic_warmup_step(copy_state(state), batch, jax.random.key(0))
    assert_params_close(new_state.critic_params, expected_critic)
    jax.tree.map(np.testing.assert_array_equal, new_state.policy_params, state.policy_params)
    assert int(new_state.step) == 1
    assert "critic/value_loss" in metrics and not any(name.startswith("policy/") for name in metrics)


def test_hl_gauss_critic_steps_are_the_hand_written_cross_entropy_steps():
    # 7 bins over [-0.5, 1.5]: edges −0.5, −0.214, …, 1.5; σ = 0.75 bin widths = 0.75 · 2/7.
    config, state, graphs, steps, policy_tx, critic_tx = make_setup("critic.value_head=hl_gauss", "critic.value_bins=7")
    assert state.critic_params["value_head"]["kernel"].shape == (tiny_qwen3_moe().hidden_size, 7)
    batch = synthetic_batch(seed=6)
    edges = jnp.linspace(-0.5, 1.5, 8)
    expected, _ = hand_written_ttur(config, state, graphs, batch, policy_tx, critic_tx, policy=False,
                                    histogram=(edges, 0.75 * 2 / 7))  # fmt: skip
    new_state, metrics = steps.critic_warmup_step(copy_state(state), batch, jax.random.key(0))
    assert_params_close(new_state.critic_params, expected)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), new_state.critic_params,
                                         state.critic_params))  # fmt: skip
    assert max(moved) > 1e-3
    # The values the advantages read are the histogram's mean.
    values, _ = steps_lib.critic_values(graphs.critic, state.critic_params, state.critic_buffers, batch, config)
    raw, _, _ = nnx.merge(graphs.critic, state.critic_params, state.critic_buffers).forward(
        batch.tokens, attention_mask=batch.valid_mask)
    np.testing.assert_allclose(values[:, 1:], losses.hl_gauss_values(raw[:, :-1], edges), rtol=1e-5, atol=1e-6)


def test_policy_update_uses_the_updated_critic(setup):
    # Swapping the order (policy first, on the stale critic) must give a different policy.
    config, state, graphs, steps, policy_tx, critic_tx = setup
    batch = synthetic_batch(seed=1)
    stale, _ = steps.policy_update(copy_state(state), batch, jax.random.key(0))
    fresh, _ = steps.ttur_step(copy_state(state), batch, jax.random.key(0))
    differences = jax.tree.leaves(jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), stale.policy_params,
                                               fresh.policy_params))  # fmt: skip
    assert max(float(d) for d in differences) > 0


def test_frozen_attention_leaves_are_bit_identical_after_a_step(setup):
    config, state, graphs, steps, *_ = setup
    before = copy_state(state.critic_params)
    after, _ = steps.ttur_step(copy_state(state), synthetic_batch(seed=2), jax.random.key(0))
    labels = label_params(before, config.critic.trainable_patterns)
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), before, after.critic_params)
    flat_labels = jax.tree.leaves(labels)
    flat_moved = jax.tree.leaves(moved)
    assert "frozen" in flat_labels and "trainable" in flat_labels
    for label, changed in zip(flat_labels, flat_moved):
        assert changed == (label == "trainable"), (label, changed)


def test_ttur_step_logs_the_critic_lag_and_group_gradient_norms(setup):
    """The fit before the K updates is the initial critic's, after them the updated critic's, each
    recomputed here from the states (values, λ_critic targets, EV and MSE written out); the frozen
    attention's gradient norm is 0 for the critic and not for the policy."""
    config, state, graphs, steps, *_ = setup
    batch = synthetic_batch(seed=3)
    after, metrics = steps.ttur_step(copy_state(state), batch, jax.random.key(0))

    def fit(critic_params):
        model = nnx.merge(graphs.critic, critic_params, state.critic_buffers)
        raw, _, _ = model.forward(batch.tokens, attention_mask=batch.valid_mask)
        values = np.concatenate([np.zeros_like(raw[:, :1]), raw[:, :-1]], axis=1)
        _, targets = adv.skip_observation_gae(batch.rewards, jnp.asarray(values), batch.action_mask, gamma=1.0, lam=1.0)
        mask = np.asarray(batch.action_mask)
        v, g = values[mask], np.asarray(targets)[mask]
        return {"explained_variance": 1 - np.var(g - v) / np.var(g), "mse": np.mean((v - g) ** 2)}

    for stage, params in (("before_updates", state.critic_params), ("after_updates", after.critic_params)):
        for name, want in fit(params).items():
            assert float(metrics[f"critic/{stage}/{name}"]) == pytest.approx(want, rel=1e-4, abs=1e-6), (stage, name)
    assert float(metrics["critic/before_updates/mse"]) != pytest.approx(float(metrics["critic/after_updates/mse"]))
    assert float(metrics["critic/grad_norm/attention"]) == 0.0 and float(metrics["critic/grad_norm/experts"]) > 0
    assert float(metrics["policy/grad_norm/attention"]) > 0
    groups = [name for name in metrics if name.startswith("policy/grad_norm/")]
    total = np.sqrt(sum(float(metrics[name]) ** 2 for name in groups))
    assert total == pytest.approx(float(metrics["policy/grad_norm"]), rel=1e-5)  # the groups partition the leaves


def moved_paths(before, after) -> set[str]:
    paths = param_paths(before)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.any(a != b)), before, after))
    assert len(paths) == len(moved)
    return {path for path, changed in zip(paths, moved) if changed}


def in_rl_set(path: str) -> bool:
    """The default `critic.trainable_patterns` written as a plain predicate: MoE projections and value head."""
    return "value_head/" in path or re.search(r"(^|/)mlp/(router|experts|shared_experts)/", path) is not None


@pytest.mark.parametrize(("pretrain_patterns", "pretrained"), [
    (None, in_rl_set),  # the default: the RL set
    ('[".*"]', lambda path: True),
    ('["(.*/)?value_head/.*"]', lambda path: path.startswith("value_head/")),
])  # fmt: skip
def test_value_pretraining_trains_its_patterns_and_the_rl_critic_update_the_rl_set(setup, pretrain_patterns, pretrained):
    _, state, graphs, *_ = setup
    overrides = [] if pretrain_patterns is None else [f"critic.pretrain_trainable_patterns={pretrain_patterns}"]
    config = load_config(None, overrides)
    paths = param_paths(state.critic_params)
    assert any(in_rl_set(p) for p in paths) and not all(in_rl_set(p) for p in paths)
    batch = synthetic_batch(seed=8)

    tx, pretrain_update = value_pretraining_update(graphs, config)
    start = copy_state(state).replace(critic_opt_state=tx.init(state.critic_params))
    pretrained_state, _ = pretrain_update(start, batch, jax.random.key(0))
    assert moved_paths(state.critic_params, pretrained_state.critic_params) == {p for p in paths if pretrained(p)}

    policy_tx, critic_tx = make_optimizers(config)
    rl_state = pretrained_state.replace(critic_opt_state=critic_tx.init(pretrained_state.critic_params),
                                        policy_opt_state=policy_tx.init(state.policy_params))  # fmt: skip
    rl_steps = steps_lib.build_steps(graphs, policy_tx, critic_tx, config)
    before = copy_state(rl_state.critic_params)
    after, _ = rl_steps.critic_warmup_step(rl_state, batch, jax.random.key(1))
    assert moved_paths(before, after.critic_params) == {p for p in paths if in_rl_set(p)}


@pytest.mark.parametrize("section", ["policy", "critic"])
def test_rl_optimizers_warm_the_learning_rate_up_linearly(section):
    """Adam's update of a constant gradient is -lr·g/(|g| + ε) ≈ -lr·sign(g) at every step, so the
    parameter's moves are the learning rates: lr·t/W for t < W updates, then lr."""
    lr, warmup = 0.1, 4
    config = load_config(None, [f"{section}.optimizer.lr={lr}", f"{section}.optimizer.warmup_steps={warmup}",
                                "critic.trainable_patterns=[.*]"])  # fmt: skip
    tx = make_optimizers(config)[0 if section == "policy" else 1]
    params = {"w": jnp.zeros(3)}
    opt_state = tx.init(params)
    moves = []
    for _ in range(6):
        updates, opt_state = tx.update({"w": jnp.full(3, 0.5)}, opt_state, params)
        moves.append(float(-updates["w"][0]))
    np.testing.assert_allclose(moves, [0.0, 0.025, 0.05, 0.075, 0.1, 0.1], rtol=1e-4, atol=1e-9)


def test_nan_reward_skips_the_update_and_is_counted(setup):
    config, state, graphs, steps, *_ = setup
    batch = synthetic_batch(seed=3)
    batch = batch.replace(rewards=batch.rewards.at[0, -1].set(jnp.nan).at[0, 5].set(jnp.nan))
    before = copy_state(state)
    after, metrics = steps.ttur_step(copy_state(state), batch, jax.random.key(0))
    for old, new in ((before.critic_params, after.critic_params), (before.policy_params, after.policy_params)):
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), old, new)
    assert int(metrics["critic/skipped_updates"]) == K
    assert int(metrics["policy/skipped_updates"]) == 1
    # and the next finite batch trains again
    again, metrics = steps.ttur_step(after, synthetic_batch(seed=4), jax.random.key(1))
    assert int(metrics["critic/skipped_updates"]) == K


def test_steps_compile_once_per_shape(setup):
    config, state, graphs, steps, *_ = setup
    s = copy_state(state)
    for seed in range(3):
        s, _ = steps.ttur_step(s, synthetic_batch(seed=seed), jax.random.key(seed))
    assert steps.ttur_step._cache_size() == 1


def test_ttur_step_holds_one_update_s_temporaries_at_a_time(setup):
    """The composed step needs about the memory of its largest update, not the sum of all of them:
    XLA:CPU's memory-ordered scheduler, which `import sao_jax` selects (its __init__), is in effect.
    With the default scheduler this program's temporaries were 1.47x its largest update's."""
    config, state, graphs, steps, *_ = setup
    batch, key = synthetic_batch(), jax.random.key(0)

    def temporaries(step):
        return step.lower(state, batch, key).compile().memory_analysis().temp_size_in_bytes

    largest = max(temporaries(steps.value_update), temporaries(steps.policy_update))
    assert temporaries(steps.ttur_step) < 1.2 * largest


@pytest.mark.parametrize("estimator", ["running_mean", "cross_observation_gae", "step_gae_mean", "step_gae_last"])
def test_every_estimator_row_runs(estimator):
    config = load_config(None, [f"advantage.estimator={estimator}"])
    policy = Policy(tiny_qwen3_moe(), rngs=nnx.Rngs(0))
    critic = Critic.from_policy(policy, rngs=nnx.Rngs(1))
    policy_tx = steps_lib.guard_nonfinite(adamw(1e-3))
    critic_tx = steps_lib.guard_nonfinite(train_only(adamw(1e-3), config.critic.trainable_patterns))
    state, graphs = steps_lib.make_train_state(policy, critic, policy_tx, critic_tx, config, num_prompts=4)
    steps = steps_lib.build_steps(graphs, policy_tx, critic_tx, config)
    state, metrics = steps.ttur_step(state, synthetic_batch(), jax.random.key(0))
    assert np.isfinite(float(metrics["policy/loss"]))
    if estimator == "running_mean":
        assert "critic/value_loss" not in metrics
        assert int(state.baseline.count.sum()) == 4  # four real rows entered their windows
