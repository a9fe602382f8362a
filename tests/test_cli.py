"""The command line: clear config errors, and the GAE demo table."""

from sao_jax.cli import evaluate_main, main


def test_config_typo_is_a_one_line_error_naming_the_key(capsys, tmp_path):
    assert main([f"output_dir={tmp_path}", "critic.updates_per_polcy_update=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "critic.updates_per_polcy_update" in err and "did you mean critic.updates_per_policy_update" in err
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing started


def test_unknown_estimator_and_loss_names_get_a_close_match(capsys):
    assert main(["advantage.estimator=skip_obs_gae"]) == 2
    assert "did you mean skip_observation_gae" in capsys.readouterr().err
    assert main(["loss.name=dys"]) == 2
    assert "did you mean dis" in capsys.readouterr().err
    assert evaluate_main(["train.mode=asynch"]) == 2
    assert "train.mode must be sync or async" in capsys.readouterr().err


def test_gae_demo_prints_both_estimators(capsys):
    assert main(["--gae-demo"]) == 0
    out = capsys.readouterr().out
    assert "mean A skip-obs" in out and "mean A cross-obs" in out
    assert out.count("| action |") == 3 and out.count("| observation |") == 2
