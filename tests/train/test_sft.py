"""SFT warm start: demonstrations laid out like sampled trajectories, and the NLL step."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sao_jax.data.tokenizers import CharTokenizer
from sao_jax.envs import environment_class
from sao_jax.models import Policy, tiny_qwen3_moe
from sao_jax.rollout.trajectory import collate
from sao_jax.train.sft import choice_mask, demonstration_probability, demonstration_trajectory, make_sft_update
from sao_jax.train.steps import split_model


def calculator_demos(n, seed=0):
    tok = CharTokenizer()
    env_cls = environment_class("calculator")
    prompts = env_cls.generate_prompts(np.random.default_rng(seed), n)
    return tok, prompts, [demonstration_trajectory(env_cls(), p, env_cls.demonstration(p), tok) for p in prompts]


def test_demonstration_layout_matches_the_agent_loop_convention():
    tok, prompts, demos = calculator_demos(3)
    for prompt, demo in zip(prompts, demos):
        text = tok.decode(demo.tokens)
        assert demo.tokens[0] == tok.bos_id
        actions = "".join(tok.decode(demo.tokens[demo.action_mask]))
        gold = "".join(environment_class("calculator").demonstration(prompt))
        assert actions == gold
        assert text.startswith(prompt.text)
        assert "<out>" + prompt.answer + "</out>" in text or "<out>" in text  # the env's own observation
        # reward 1 on the very last token, which is an action token; nothing elsewhere
        assert demo.rewards[-1] == 1.0 and demo.action_mask[-1] and demo.rewards.sum() == 1.0
        # turns: prompt -1, then 0 for the tool call and its observation, 1 for the answer
        assert demo.turn_index[0] == -1 and demo.turn_index[-1] == 1
        assert set(np.unique(demo.turn_index[demo.action_mask])) == {0, 1}


def test_a_demonstration_that_stops_before_the_episode_ends_ends_with_its_last_action():
    """As a rollout does: the observation the last action would get is not part of the trajectory
    (repair's weak demonstration without the repair must not show its failed test)."""
    tok = CharTokenizer()
    env_cls = environment_class("calculator")
    (prompt,) = env_cls.generate_prompts(np.random.default_rng(0), 1)
    call = env_cls.demonstration(prompt)[0]
    demo = demonstration_trajectory(env_cls(), prompt, [call], tok)
    assert demo.num_tokens == 1 + len(prompt.text) + len(call) and demo.action_mask[-1]
    assert "<out>" not in tok.decode(demo.tokens) and demo.rewards.sum() == 0.0
    full = demonstration_trajectory(env_cls(), prompt, env_cls.demonstration(prompt), tok)
    assert "<out>" in tok.decode(full.tokens)  # observations between actions are kept


def test_sft_update_minimises_the_action_token_nll():
    tok, _, demos = calculator_demos(4)
    batch = collate(demos, buckets=(96,))
    policy = Policy(tiny_qwen3_moe(vocab_size=tok.vocab_size), rngs=nnx.Rngs(0))
    graph, params, buffers = split_model(policy)

    # the reported NLL equals a numpy log-softmax over the action tokens (read one position back)
    forward = nnx.jit(lambda model, tokens, mask: model(tokens, attention_mask=mask))  # one compile, not op by op
    logits = np.asarray(forward(policy, jnp.asarray(batch.tokens), jnp.asarray(batch.valid_mask)), np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    picked = np.take_along_axis(logits[:, :-1], batch.tokens[:, 1:, None], axis=-1)[..., 0] - logz[:, :-1]
    expected = -picked[batch.action_mask[:, 1:]].mean()

    tx = optax.adam(3e-3)
    update = make_sft_update(graph, buffers, tx)
    params, opt_state, metrics = update(params, tx.init(params), batch)
    np.testing.assert_allclose(float(metrics["sft/nll"]), expected, rtol=1e-5)
    for _ in range(20):
        params, opt_state, metrics = update(params, opt_state, batch)
    assert float(metrics["sft/nll"]) < 0.8 * expected  # it fits the demonstrations


def test_observations_carry_the_turn_of_the_action_before_them():
    tok, _, demos = calculator_demos(3)
    for demo in demos:
        after_prompt = np.arange(len(demo.tokens)) >= np.flatnonzero(demo.action_mask)[0]
        observation = after_prompt & ~demo.action_mask
        assert observation.any()
        # the tool call is turn 0 and its observation follows it, before the answer (turn 1)
        np.testing.assert_array_equal(demo.turn_index[observation], 0)


def test_demonstration_without_bos_starts_with_the_prompt():
    tok = CharTokenizer()
    env_cls = environment_class("calculator")
    prompt = env_cls.generate_prompts(np.random.default_rng(0), 1)[0]
    with_bos = demonstration_trajectory(env_cls(), prompt, env_cls.demonstration(prompt), tok)
    without = demonstration_trajectory(env_cls(), prompt, env_cls.demonstration(prompt), tok, add_bos=False)
    np.testing.assert_array_equal(without.tokens, with_bos.tokens[1:])
    assert tok.decode(without.tokens).startswith(prompt.text)


def test_sft_token_accuracy_compares_each_prediction_with_the_next_token():
    tok, _, demos = calculator_demos(4)
    batch = collate(demos, buckets=(96,))
    policy = Policy(tiny_qwen3_moe(vocab_size=tok.vocab_size), rngs=nnx.Rngs(0))
    graph, params, buffers = split_model(policy)
    tx = optax.adam(3e-3)
    update = make_sft_update(graph, buffers, tx)
    params, opt_state, _ = update(params, tx.init(params), batch)
    for _ in range(15):  # until some predictions are right
        params, opt_state, _ = update(params, opt_state, batch)
    forward = nnx.jit(lambda model, tokens, mask: model(tokens, attention_mask=mask))
    trained = nnx.merge(graph, params, buffers)
    logits = np.asarray(forward(trained, jnp.asarray(batch.tokens), jnp.asarray(batch.valid_mask)))
    hits = logits[:, :-1].argmax(-1) == batch.tokens[:, 1:]  # position t predicts token t + 1
    expected = hits[batch.action_mask[:, 1:]].mean()
    assert 0 < expected < 1
    _, _, metrics = update(params, opt_state, batch)  # metrics of the params before this step
    assert float(metrics["sft/token_accuracy"]) == pytest.approx(expected)


def test_choice_mask_marks_only_the_token_where_the_weak_demonstrator_branches_off():
    tok = CharTokenizer()
    env_cls = environment_class("calculator")
    (prompt,) = env_cls.generate_prompts(np.random.default_rng(3), 1)
    gold = demonstration_trajectory(env_cls(), prompt, env_cls.demonstration(prompt), tok)
    weak = demonstration_trajectory(env_cls(), prompt, env_cls.weak_demonstration(prompt), tok)
    free = choice_mask(gold, weak)
    # [bos] "Q: ...=?\n" "<calc>...": the tool's tag letter ("c" against the estimator's "e") is the choice
    branch = 1 + len(prompt.text) + 1
    assert tok.decode(gold.tokens[branch:branch + 1]) == "c" and tok.decode(weak.tokens[branch:branch + 1]) == "e"
    assert np.flatnonzero(free).tolist() == [branch]
    assert not choice_mask(gold, None).any() and not choice_mask(gold, gold).any()


def test_demonstration_probability_multiplies_the_counted_action_token_probabilities():
    rng = np.random.default_rng(0)
    logprobs = np.log(rng.uniform(0.2, 1.0, (3, 7))).astype(np.float32)
    action = rng.random((3, 7)) < 0.6
    free = np.zeros((3, 7), bool)
    free[0, np.flatnonzero(action[0])[0]] = True
    expected = []
    for i in range(3):
        p = 1.0
        for t in range(7):
            if action[i, t] and not free[i, t]:
                p *= float(np.exp(logprobs[i, t]))
        expected.append(p)
    got = demonstration_probability(jnp.asarray(logprobs), jnp.asarray(action), jnp.asarray(free))
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5)


@pytest.mark.slow
def test_sft_stops_at_the_first_check_that_reaches_the_target(tmp_path, monkeypatch):
    """The criterion's logic on a tiny run: probed values 0.3 then 0.9 against a target of 0.8 stop SFT
    at the second check; a target no policy meets runs to the cap; the probability logged there is
    the held-out gold demonstrations' (the tool's tag letter left out), recomputed with numpy."""
    from sao_jax.config import load_config
    from sao_jax.metrics import MetricsWriter, read_metrics
    from sao_jax.train import build, warm_start

    def sft(name, target):
        config = load_config(overrides=["sft.steps=6", "sft.batch_size=4", "sft.check_every=2", "sft.probe_prompts=3",
                                        f"sft.target_demonstration_probability={target}", "env.train_prompts=16",
                                        f"output_dir={tmp_path / name}"])  # fmt: skip
        run = build.build_run(config)
        with MetricsWriter(tmp_path / name, tensorboard=False) as writer:
            params = warm_start.run_sft(run, writer)
        lines = [line for line in read_metrics(tmp_path / name / "metrics.jsonl") if line.get("stage") == "sft"]
        return run, config, params, lines

    with monkeypatch.context() as patch:
        probed = iter([0.3, 0.9])
        patch.setattr(warm_start, "demonstration_probe", lambda *args: lambda params: next(probed))
        _, _, _, lines = sft("scripted", 0.8)
    assert [line.get("sft/demonstration_probability") for line in lines if line["sft/step"] in (1, 3)] == [0.3, 0.9]
    assert lines[-1]["sft/step"] == 3 and lines[-1]["sft/stopped_at_target"] == 1
    run, config, params, lines = sft("hard", 1.0)
    checks = [line for line in lines if "sft/demonstration_probability" in line]
    assert [line["sft/step"] for line in checks] == [1, 3, 5]
    assert lines[-1]["sft/step"] == 5 and lines[-1]["sft/stopped_at_target"] == 0

    prompts = build.prompt_pool(config, run.env_cls, None, 3, build.SFT_PROBE_STREAM, key="env.eval_file")
    graph, _, buffers = split_model(run.policy)
    model = nnx.merge(graph, params, buffers)
    expected = []
    for prompt in prompts:
        actions = run.env_cls.demonstration(prompt)
        demo = demonstration_trajectory(run.env_cls(), prompt, actions, run.tokenizer)
        logits = np.asarray(model(jnp.asarray(demo.tokens[None]))[0], np.float64)
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
        tag_letter = 1 + len(prompt.text) + 1
        total = sum(logp[t - 1, demo.tokens[t]] for t in range(1, demo.num_tokens)
                    if demo.action_mask[t] and t != tag_letter)
        expected.append(np.exp(total))
    assert checks[-1]["sft/demonstration_probability"] == pytest.approx(float(np.mean(expected)), rel=1e-4)


def test_sft_demonstrates_the_whole_training_pool_while_rl_draws_from_its_first_rl_prompts(tmp_path, monkeypatch):
    """`env.rl_prompts=4` of a 16-prompt pool: the run's RL prompts are the pool's first 4 (ids 0-3),
    SFT's the whole pool, and SFT's batches draw from all 16 (a pool too small to demonstrate alone)."""
    from sao_jax.config import load_config
    from sao_jax.metrics import MetricsWriter
    from sao_jax.train import build, warm_start

    overrides = ["sft.steps=3", "sft.batch_size=8", "sft.target_demonstration_probability=0", "env.train_prompts=16",
                 f"output_dir={tmp_path}"]  # fmt: skip
    whole = build.build_run(load_config(overrides=overrides))
    run = build.build_run(load_config(overrides=[*overrides, "env.rl_prompts=4"]))
    assert [p.text for p in run.sft_prompts] == [p.text for p in whole.sft_prompts] == [p.text for p in whole.train_prompts]
    assert [p.text for p in run.train_prompts] == [p.text for p in whole.train_prompts[:4]]
    assert [p.id for p in run.train_prompts] == [0, 1, 2, 3]
    demonstrated = []
    demonstration = run.demonstration
    monkeypatch.setattr(run, "demonstration", lambda prompt, **kw: demonstrated.append(prompt.id) or demonstration(prompt, **kw))
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        warm_start.run_sft(run, writer)
    assert len(demonstrated) == 24 and max(demonstrated) >= 4  # P(all 24 draws among the first 4) = 4^-24


def test_rl_prompts_beyond_the_pool_is_one_error_naming_the_key():
    from sao_jax.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"^env.rl_prompts must be at most env.train_prompts=16, .*\(got 17\)"):
        load_config(overrides=["env.train_prompts=16", "env.rl_prompts=17"])
