"""The C++ GAE kernel (`sao_jax/native`): against the plain-Python reference at row counts around
its 8-row blocks, in float64, on sharded inputs; how its build fails; the fallback without it.
(tests/test_advantages.py runs every skip-observation test on the kernel as well.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from sao_jax import advantages as adv
from sao_jax import native
from tests.test_advantages import random_trajectories, ref_batch, ref_skip_observation_gae


@pytest.fixture(scope="module")
def kernel_gae():
    assert native.gae_kernel_available()
    return jax.jit(lambda r, v, m, l: adv.skip_observation_gae(r, v, m, gamma=0.95, lam=l,
                                                               method="kernel"))


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 17])  # a partial block, one, one + a tail, two + one
def test_kernel_matches_reference_around_its_row_blocks(kernel_gae, rows):
    rng = np.random.default_rng(rows)
    rewards, values, action, _ = random_trajectories(rng, batch=rows, time=23)
    lam = rng.uniform(0, 1, rows).astype(np.float32)
    got_advantages, got_returns = kernel_gae(rewards, values, action, lam)
    for row in range(rows):
        want_advantages, want_returns = ref_skip_observation_gae(
            rewards[row], values[row], action[row], 0.95, float(lam[row]))
        np.testing.assert_allclose(got_advantages[row], want_advantages, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(got_returns[row], want_returns, rtol=2e-5, atol=2e-5)


def test_kernel_in_float64():
    rewards, values, action, _ = random_trajectories(np.random.default_rng(1), batch=5, time=30)
    with jax.enable_x64(True):
        got, _ = adv.skip_observation_gae(rewards.astype(np.float64), values.astype(np.float64),
                                          action, gamma=0.9, lam=0.7, method="kernel")
        assert got.dtype == jnp.float64
    want, _ = ref_batch(ref_skip_observation_gae, rewards, values, action, gamma=0.9, lam=0.7)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_kernel_on_inputs_sharded_over_eight_devices(kernel_gae):
    mesh = jax.make_mesh((8,), ("data",))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    rewards, values, action, _ = random_trajectories(np.random.default_rng(2), batch=16, time=20)
    lam = np.full(16, 0.9, np.float32)
    got, _ = kernel_gae(*(jax.device_put(x, rows) for x in (rewards, values, action, lam)))
    want, _ = ref_batch(ref_skip_observation_gae, rewards, values, action, gamma=0.95, lam=0.9)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_auto_picks_the_kernel_on_cpu_and_the_scan_without_it(monkeypatch):
    assert adv._resolve_method("auto", "test", kernel=True) == "kernel"
    assert adv._resolve_method("auto", "test", kernel=False) == "scan"
    monkeypatch.setattr(native, "gae_kernel_available", lambda: False)
    assert adv._resolve_method("auto", "test", kernel=True) == "scan"
    with pytest.raises(RuntimeError, match="could not be built"):
        adv._resolve_method("kernel", "test", kernel=True)


def test_build_without_a_compiler_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    monkeypatch.setenv("SAO_JAX_KERNEL_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler found.*no-such-c\\+\\+-compiler"):
        native._build(native._HERE / "gae_cpu.cc")


def test_build_failure_shows_the_compiler_output_and_leaves_no_library(monkeypatch, tmp_path):
    monkeypatch.setenv("SAO_JAX_KERNEL_CACHE", str(tmp_path / "cache"))
    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++\n")
    with pytest.raises(RuntimeError, match="compiling broken.cc failed(.|\n)*error"):
        native._build(broken)
    assert not list((tmp_path / "cache").glob("*.so"))


def test_build_is_cached_by_source(monkeypatch, tmp_path):
    monkeypatch.setenv("SAO_JAX_KERNEL_CACHE", str(tmp_path))
    source = tmp_path / "tiny.cc"
    source.write_text('extern "C" int tiny() { return 1; }\n')
    first = native._build(source)
    assert native._build(source) == first and first.stat().st_size > 0
    source.write_text('extern "C" int tiny() { return 2; }\n')
    assert native._build(source) != first


def test_build_is_cached_by_the_headers_beside_the_source(monkeypatch, tmp_path):
    monkeypatch.setenv("SAO_JAX_KERNEL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "value.h").write_text("#define VALUE 1\n")
    source = tmp_path / "tiny.cc"
    source.write_text('#include "value.h"\nextern "C" int tiny() { return VALUE; }\n')
    first = native._build(source)
    (tmp_path / "value.h").write_text("#define VALUE 2\n")
    assert native._build(source) != first
