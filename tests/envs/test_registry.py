"""What every registered environment's prompt generator promises (`sao_jax.envs.base`): the same
prompts for the same seed, other prompts for another seed, and a distinct id per prompt."""

import numpy as np
import pytest

from sao_jax.envs import ENVIRONMENTS


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_generator_is_deterministic_per_seed_with_distinct_ids(name):
    generate = ENVIRONMENTS[name].generate_prompts
    a, b, c = (generate(np.random.default_rng(seed), 20) for seed in (3, 3, 4))
    assert a == b
    assert [p.text for p in a] != [p.text for p in c]
    assert len({p.id for p in a}) == len(a)

