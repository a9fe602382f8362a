"""Config loading: base inheritance, overrides, and errors that name the key."""

import re

import pytest

from sao_jax.config import Config, ConfigError, OptimizerConfig, load_config
from sao_jax.train.build import build_run


def write(path, text):
    path.write_text(text)
    return path


def test_no_file_gives_embedded_default():
    config = load_config()
    assert config == Config()
    assert config.seed == 0 and config.output_dir


def test_base_file_holds_only_the_difference(tmp_path):
    write(tmp_path / "sao.yaml", "seed: 3\ncritic:\n  updates_per_policy_update: 2\n")
    (tmp_path / "ablations").mkdir()
    child = write(tmp_path / "ablations" / "k1.yaml", "base: ../sao.yaml\ncritic:\n  updates_per_policy_update: 1\n")
    config = load_config(child)
    assert config.seed == 3  # inherited
    assert config.critic.updates_per_policy_update == 1  # overridden
    assert config.critic.warmup_steps == Config().critic.warmup_steps  # untouched default


def test_child_file_setting_one_key_of_a_section_keeps_the_base_files_other_keys_of_it(tmp_path):
    write(tmp_path / "parent.yaml", "critic:\n  updates_per_policy_update: 3\n  warmup_steps: 7\n")
    child = write(tmp_path / "child.yaml", "base: parent.yaml\ncritic:\n  updates_per_policy_update: 1\n")
    config = load_config(child)
    assert config.critic.updates_per_policy_update == 1  # the child's
    assert config.critic.warmup_steps == 7 != Config().critic.warmup_steps  # the parent's, not the default


def test_nested_section_keeps_its_parents_defaults(tmp_path):
    # The critic's optimizer has its own default lr (not OptimizerConfig's); setting another key of
    # that section must not reset it to the class default.
    config = load_config(None, ["critic.optimizer.warmup_steps=5"])
    assert config.critic.optimizer.lr == Config().critic.optimizer.lr != OptimizerConfig().lr
    assert config.critic.optimizer.warmup_steps == 5
    assert config.policy.optimizer.lr == Config().policy.optimizer.lr


def test_overrides_parse_yaml_scalars_and_lists():
    config = load_config(None, ["loss.name=estr", "loss.estr_tau=0.5", "critic.trainable_patterns=[mlp, value_head]"])
    assert config.loss.name == "estr"
    assert config.loss.estr_tau == 0.5
    assert config.critic.trainable_patterns == ("mlp", "value_head")


def test_int_is_accepted_for_float_but_not_the_reverse():
    assert load_config(None, ["advantage.gamma=1"]).advantage.gamma == 1.0
    with pytest.raises(ConfigError, match=r"critic\.updates_per_policy_update must be an integer"):
        load_config(None, ["critic.updates_per_policy_update=1.5"])


def test_a_bool_is_not_taken_for_an_integer():
    # Python's True is an int; a config must still refuse `steps: true`.
    with pytest.raises(ConfigError, match=r"^train\.steps must be an integer \(got True\) in <defaults>"):
        load_config(None, ["train.steps=true"])


def test_each_list_item_is_checked_and_named_by_its_index():
    assert load_config(None, ["env.difficulty=[1, 3]"]).env.difficulty == (1, 3)
    with pytest.raises(ConfigError, match=r"^env\.difficulty\[1\] must be an integer \(got 'x'\)"):
        load_config(None, ["env.difficulty=[1, x]"])


def test_unknown_key_names_key_file_and_close_match(tmp_path):
    path = write(tmp_path / "x.yaml", "critic:\n  updates_per_polcy_update: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "critic.updates_per_polcy_update" in message
    assert "x.yaml" in message
    assert "did you mean critic.updates_per_policy_update" in message


def test_invalid_value_names_key_and_fix():
    with pytest.raises(ConfigError, match=r"critic\.updates_per_policy_update must be >= 1 \(got 0\)"):
        load_config(None, ["critic.updates_per_policy_update=0"])
    with pytest.raises(ConfigError, match=r"advantage\.gamma must be in \[0, 1\]"):
        load_config(None, ["advantage.gamma=2"])


def test_section_given_a_scalar_is_an_error():
    with pytest.raises(ConfigError, match="critic must be a section"):
        load_config(None, ["critic=3"])


def test_malformed_override_and_missing_file_and_cycle(tmp_path):
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(None, ["seed"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    write(tmp_path / "a.yaml", "base: b.yaml\n")
    write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")


def test_config_is_frozen():
    config = load_config()
    with pytest.raises(AttributeError):
        config.seed = 1  # type: ignore[misc]


def test_exponent_without_dot_is_a_float(tmp_path):
    # PyYAML follows YAML 1.1 and reads `1e-6` as a string; a learning rate must still load.
    path = write(tmp_path / "lr.yaml", "policy:\n  optimizer:\n    lr: 1e-6\n")
    assert load_config(path).policy.optimizer.lr == pytest.approx(1e-6)
    with pytest.raises(ConfigError, match="policy.optimizer.lr must be a number"):
        load_config(None, ["policy.optimizer.lr=fast"])


SCAFFOLD = ["env.name=scaffold", "sft.steps=0", "model.pretrained=/no/such/folder"]


@pytest.mark.parametrize(("overrides", "key"), [
    (SCAFFOLD, "scaffold.entry"),  # neither entry nor command
    ([*SCAFFOLD, "scaffold.entry=m:f", "scaffold.command=run.sh"], "scaffold.entry"),  # both
    ([*SCAFFOLD[:2], "scaffold.entry=m:f"], "model.pretrained"),  # no chat template to speak in
    (["env.name=scaffold", "model.pretrained=x", "scaffold.entry=m:f"], "sft.steps"),  # no demonstrations
    ([*SCAFFOLD, "scaffold.entry=m:f", "train.probe_every=5"], "train.probe_every"),
    (["scaffold.entry=not a function"], "scaffold.entry"),
])  # fmt: skip
def test_a_scaffold_run_names_what_it_is_missing(overrides, key):
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)} "):
        load_config(None, overrides)


def test_a_scaffold_entry_that_does_not_import_is_named_before_anything_loads():
    config = load_config(None, [*SCAFFOLD, "scaffold.entry=sao_jax.envs.toy_repo:no_such_function"])
    with pytest.raises(ConfigError, match=r"^scaffold.entry=sao_jax.envs.toy_repo:no_such_function cannot be loaded"):
        build_run(config)
