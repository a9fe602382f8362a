"""Cost of the checkpoint digests (`sao_jax.checkpoint.checksums` at save, the same pass plus the
finite check at restore) on the `moe_1b` train state.

    python benchmarks/checkpoint_digest.py            # the state's bytes, and the rate on --gib GiB of it
    python benchmarks/checkpoint_digest.py --full     # on the whole state (needs its memory: ~13 GiB)

The state's layout (model + both optimizer states, default config: frozen-attention critic) comes
from `jax.eval_shape`, so nothing is allocated for it. Without `--full` the digest runs on leaves of
that state taken in order until `--gib` GiB are filled, with random contents, and the time for the
whole state is extrapolated from the rate (the pass is one read of every byte: linear in bytes). The
same arrays are also saved with Orbax alone (synchronously, to a temporary folder), so the digest's
cost reads as a fraction of the save it is added to, which holds on a loaded machine too.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import moe_1b  # noqa: E402

from sao_jax.checkpoint import _verify_values  # noqa: E402
from sao_jax.cli import set_xla_flags  # noqa: E402
from sao_jax.config import Config  # noqa: E402
from sao_jax.models import Critic, Policy  # noqa: E402
from sao_jax.train import steps as steps_lib  # noqa: E402
from sao_jax.train.build import make_optimizers  # noqa: E402


def abstract_moe_1b_state():
    config = Config()
    policy_tx, critic_tx = make_optimizers(config)

    def build():
        policy = Policy(moe_1b(), rngs=nnx.Rngs(0))
        critic = Critic.from_policy(policy, rngs=nnx.Rngs(1))
        return steps_lib.make_train_state(policy, critic, policy_tx, critic_tx, config, num_prompts=1024)[0]

    return jax.eval_shape(build)


def main() -> None:
    set_xla_flags()  # XLA:CPU's scheduler as `sao-train` sets it, before any JAX call (sao_jax/cli.py)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    leaves = [leaf for leaf in jax.tree.leaves(abstract_moe_1b_state()) if hasattr(leaf, "shape")]
    total = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
    print(f"moe_1b train state: {len(leaves)} arrays, {total / 2**30:.2f} GiB on {jax.devices()[0].platform}")
    chosen, size = [], 0
    for leaf in leaves:
        if not args.full and size >= args.gib * 2**30:
            break
        chosen.append(leaf)
        size += leaf.size * leaf.dtype.itemsize
    key = jax.random.key(0)
    arrays = [jax.random.normal(jax.random.fold_in(key, i), leaf.shape).astype(leaf.dtype)
              if jnp.issubdtype(leaf.dtype, jnp.floating) else jnp.zeros(leaf.shape, leaf.dtype)
              for i, leaf in enumerate(chosen)]  # fmt: skip
    jax.block_until_ready(_verify_values(arrays))  # compile
    digest = median_seconds(lambda: jax.block_until_ready(_verify_values(arrays)), args.repeats)
    with tempfile.TemporaryDirectory() as folder, ocp.StandardCheckpointer() as checkpointer:
        def orbax_save():
            checkpointer.save(f"{folder}/{time.monotonic_ns()}", arrays)
            checkpointer.wait_until_finished()

        save = median_seconds(orbax_save, args.repeats)
    rate = size / digest
    print(f"digest + finite check: {size / 2**30:.2f} GiB in {digest:.3f} s = {rate / 2**30:.2f} GiB/s "
          f"({digest / save:.0%} of Orbax's own save of them, {save:.3f} s); "
          f"the whole state: {total / rate:.2f} s per save and per restore")


def median_seconds(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


if __name__ == "__main__":
    main()
