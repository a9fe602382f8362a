"""The sampler's decode backends: what runs the hot operations of its prefill and decode programs.

A `Sampler` is built with one (`decode_backend`, the run config's `rollout.decode_backend`), chosen
once by `resolve_decode_backend`:

  "xla"         the model as written, every operation lowered by XLA: any platform.
  "native_cpu"  XLA:CPU only. A decode step's attention over the KV cache read in place, its
                few-row projections and LM head, its dense MLPs and its routed experts (the
                "blocked" dispatch, on the expert weights packed once per weight version) run the
                C++ kernels of `sao_jax.native`; the per-slot uniforms are a written-out threefry;
                XLA:CPU's YNNPACK dot fusions are off (`native.decode`). The same numbers up to
                float rounding (the uniforms, hence the draws at equal log μ, bit for bit). A kernel
                that does not take a shape, or that could not be built (no C++ compiler: logged
                once), leaves its operation to XLA.
  "auto"        (the default) "native_cpu" where JAX's default backend is the CPU, else "xla".

Why a choice at all: on a few-core CPU XLA's own code for a decode step — dots of a few rows, the
einsum attention that copies every layer's cache into its dots' layouts, threefry as a while loop —
runs far below the machine's memory bandwidth, and the kernels decode several times faster
(benchmarks/RESULTS.md, "Sampler"). On accelerators XLA's lowering is the one that runs. The model
knows nothing of platforms: it takes the backend's `DecodeKernels` as an argument of
`Policy.forward` (`sao_jax.models.layers.DecodeKernels`), and without one it is the model as written.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax import native
from sao_jax.models import moe
from sao_jax.models.config import ModelConfig
from sao_jax.models.layers import NO_KERNELS, DecodeKernels
from sao_jax.native import decode as native_decode

DECODE_BACKENDS = ("auto", "xla", "native_cpu")


def resolve_decode_backend(name: str, *, key: str = "decode_backend") -> str:
    """"xla" or "native_cpu" for a name in `DECODE_BACKENDS` on this machine's JAX default backend;
    a ValueError naming `key` for an unknown name, or for "native_cpu" off the CPU."""
    if name not in DECODE_BACKENDS:
        raise ValueError(f"{key} must be one of {', '.join(DECODE_BACKENDS)} (got {name!r})")
    platform = jax.default_backend()
    if name == "auto":
        return "native_cpu" if platform == "cpu" else "xla"
    if name == "native_cpu" and platform != "cpu":
        raise ValueError(f"{key}=native_cpu runs C++ kernels through XLA:CPU only, and JAX's backend here is "
                         f"{platform}: use auto or xla")  # fmt: skip
    return name


def decode_backend(name: str, graphdef, config: ModelConfig) -> XlaDecode | NativeCpuDecode:
    """The backend `name` (`resolve_decode_backend`) for a sampler of the model `graphdef` / `config`."""
    if resolve_decode_backend(name) == "xla":
        return XlaDecode()
    return NativeCpuDecode(graphdef, config)


def slot_uniforms(keys: jax.Array, slots: jax.Array) -> jax.Array:
    """u[b] = jax.random.uniform(jax.random.fold_in(keys[b], slots[b]), ()): the number at which the
    token that lands in cache slot slots[b] of row b is drawn (`sampler.sample_from`). float32 in
    [0, 1); keys: typed PRNG keys [batch]; slots: int [batch]."""
    return jax.vmap(lambda key, slot: jax.random.uniform(jax.random.fold_in(key, slot), ()))(keys, slots)


class XlaDecode:
    """The "xla" backend: no kernels, JAX's own random numbers, XLA's default compiler options."""

    name = "xla"
    compiler_options = None

    def prepare(self, params) -> tuple:
        """What the decode programs take beside the params: nothing."""
        return ()

    def kernels(self, model, prepared) -> DecodeKernels:
        return NO_KERNELS

    def slot_uniforms(self, keys: jax.Array, slots: jax.Array) -> jax.Array:
        return slot_uniforms(keys, slots)

    def attends_filled_slots_only(self, config: ModelConfig, cache_dtype) -> bool:
        """Whether a decode step's attention reads only each row's filled slots (so the sampler need
        not cut the cache to a window): the einsum reads every slot it is given."""
        return False


class NativeCpuDecode:
    """The "native_cpu" backend for one model. It keeps the MoE layers' expert weights packed for the
    experts' kernel (`native.decode.pack_experts`), made when a call brings new weight arrays and
    reused while the same arrays come in (`prepare`)."""

    name = "native_cpu"
    compiler_options = native_decode.COMPILER_OPTIONS

    def __init__(self, graphdef, config: ModelConfig):
        self.packs_experts = (config.num_experts > 0 and config.moe_dispatch == "blocked"
                              and native_decode.routed_swiglu_takes(config.compute_dtype, config.hidden_size,
                                                                    config.moe_intermediate_size)
                              and native.expert_swiglu_available())  # fmt: skip
        self._pack = jax.jit(lambda params: pack_experts(nnx.merge(graphdef, params)))
        self._packed = ((), ())  # (the params' leaves, their experts packed): the last weights seen

    def prepare(self, params) -> tuple[jax.Array, ...]:
        """The MoE layers' expert weights packed for the experts' kernel (`pack_experts`), or () where
        that kernel does not run. Packed once per weight version: the last params' leaves are kept
        and the packing reused while the same arrays come in (JAX arrays do not change), so the
        engine's chunks over one published version pack once. Inside the jitted decode, packing on
        every call cost the d256 MoE (batch 32) more than it saved (50 MB of transposes a chunk)."""
        if not self.packs_experts:
            return ()
        leaves = jax.tree.leaves(params)
        seen, packed = self._packed
        if len(seen) != len(leaves) or any(a is not b for a, b in zip(seen, leaves)):
            packed = self._pack(params)
            self._packed = (leaves, packed)  # one assignment: threads sharing the sampler see a whole pair
        return packed

    def kernels(self, model, prepared) -> NativeCpuKernels:
        return NativeCpuKernels(model, prepared)

    def slot_uniforms(self, keys: jax.Array, slots: jax.Array) -> jax.Array:
        return native_decode.slot_uniforms(keys, slots)

    def attends_filled_slots_only(self, config: ModelConfig, cache_dtype) -> bool:
        """Whether a decode step runs the attention kernel, which reads only each row's filled slots."""
        return (native_decode.cached_attention_takes(config.num_heads, config.num_kv_heads, config.head_dim,
                                                     cache_dtype) and native.cached_attention_available())  # fmt: skip


def _experts_modules(model) -> list[moe.Experts]:
    return [module for _, module in model.iter_modules() if isinstance(module, moe.Experts)]


def pack_experts(model) -> tuple[jax.Array, ...]:
    """`native.decode.pack_experts` of each Experts module of `model` (a Policy), in module order, cast
    to its compute dtype."""
    dtype = model.config.compute_dtype
    return tuple(native_decode.pack_experts(*(w[...].astype(dtype) for w in (e.gate_proj, e.up_proj, e.down_proj)))
                 for e in _experts_modules(model))  # fmt: skip


def _matmuls(x: jax.Array, ws: Sequence[jax.Array]) -> list[jax.Array]:
    """[x · w for w in ws] (x [..., depth], w [depth, width_i]) as one `few_rows_matmul` (leading axes
    flattened into rows) against the ws side by side: one kernel call, one round of the thread pool,
    where there would be len(ws). The weights do not change inside a decode loop, so XLA hoists their
    concatenation out of it. The sampler joins q, k and v, and a dense MLP's gate and up, this way
    (benchmarks/RESULTS.md)."""
    w = ws[0] if len(ws) == 1 else jnp.concatenate(ws, axis=1)
    y = native_decode.few_rows_matmul(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[1])
    ends = [sum(w.shape[1] for w in ws[: i + 1]) for i in range(len(ws) - 1)]
    return jnp.split(y, ends, axis=-1) if ends else [y]


class NativeCpuKernels(DecodeKernels):
    """The `DecodeKernels` of "native_cpu" for one merged model and its packed experts: each hook takes
    a decode step's operation (one token per row) where its kernel takes the shapes and dtypes and
    could be built, and declines (None) everything else."""

    def __init__(self, model=None, packed: tuple[jax.Array, ...] = ()):
        """`packed`: `pack_experts(model)` (none: the experts run XLA's dispatch)."""
        modules = _experts_modules(model) if packed else []
        if len(packed) != len(modules):
            raise ValueError(f"{len(packed)} packed expert layouts for {len(modules)} Experts modules")
        self._packed = list(zip(modules, packed))

    def attention(self, q, k, v, cache_kv, layout):
        """`native.decode.cached_attention`: it reads only the slots each row attends, so a caller
        need not cut the cache to a window of slots first (`Sampler.decode_chunk`)."""
        cache_k, cache_v = cache_kv
        if q.shape[1] != 1 or not (native_decode.cached_attention_takes(q.shape[2], cache_k.shape[2], q.shape[3],
                                                                        cache_k.dtype)
                                   and native.cached_attention_available()):  # fmt: skip
            return None
        out, cache_k, cache_v = native_decode.cached_attention(q, k, v, layout.write_slots, layout.num_keys,
                                                               cache_k, cache_v)  # fmt: skip
        return out, (cache_k, cache_v)

    def einsums(self, equation, x, kernels):
        """One `_matmuls` call for the kernels side by side, at a decode step (x [batch, 1, ...]) where
        `few_rows_matmul` takes the rows, the contracted depth and the summed width."""
        x_axes, kernel_axes = equation.split("->")[0].split(",")
        contracted = sum(axis in x_axes for axis in kernel_axes)
        kept, depth = x.shape[: x.ndim - contracted], math.prod(kernels[0].shape[:contracted])
        width = sum(w.size for w in kernels) // depth
        if x.shape[1] != 1 or not self._few_rows(math.prod(kept), depth, width, x.dtype):
            return None
        ys = _matmuls(x.reshape(*kept, depth), [w.reshape(depth, -1) for w in kernels])
        return [y.reshape(*kept, *w.shape[contracted:]) for y, w in zip(ys, kernels)]

    def swiglu(self, x, gate, up, down):
        """A decode step's x [batch, 1, embed]: gate and up in one `_matmuls` call, then down."""
        if not (x.ndim == 3 and x.shape[1] == 1 and all(self._few_rows(x.shape[0], *w.shape, x.dtype)
                                                        for w in (gate, down))):  # fmt: skip (so does [gate | up])
            return None
        x_gate, x_up = _matmuls(x, (gate, up))
        return _matmuls(jax.nn.silu(x_gate) * x_up, [down])[0]

    def routed_experts(self, layer, x, token_mask, expert_ids, weights):
        """`native.decode.routed_swiglu_packed` on this layer's packed weights, at the calls where the
        "blocked" dispatch would take `moe.few_tokens_dispatch` and at every decode step (at any
        batch: the kernel reads each chosen expert once)."""
        packed = next((layout for experts, layout in self._packed if experts is layer.experts), None)
        tokens, time = x.shape[0], token_mask.shape[1]
        few_tokens = tokens <= moe.FEW_TOKENS_PER_EXPERT * layer.config.num_experts
        if packed is None or not (few_tokens or time == 1) or not native_decode.routed_swiglu_takes(
                x.dtype, x.shape[1], layer.config.moe_intermediate_size):  # fmt: skip
            return None
        return native_decode.routed_swiglu_packed(x, expert_ids, weights, packed)

    @staticmethod
    def _few_rows(rows: int, depth: int, width: int, dtype) -> bool:
        return native_decode.few_rows_matmul_takes(rows, depth, width, dtype) and native.few_rows_matmul_available()
