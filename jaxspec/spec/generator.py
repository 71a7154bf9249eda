"""Host side of speculative generation: the target-only driver with the speculative prefill and step plugged in."""

from __future__ import annotations

import jax
from flax import nnx

from jaxspec import sharding
from jaxspec.checkpoints.heads import validate_head
from jaxspec.errors import JaxspecError
from jaxspec.generation import TargetGenerator
from jaxspec.memory import device_bytes
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.models.llama import LlamaModel
from jaxspec.spec import engine
from jaxspec.spec.tree import TreeConfig
from pallas_kernels.dispatch import IMPLEMENTATIONS, resolve_kernels

_prefill = jax.jit(
    engine.prefill,
    static_argnames=("target_graphdef", "head_graphdef", "capacity", "max_new_tokens", "sampling", "num_draft"),
)
_steps = jax.jit(
    engine.spec_steps,
    static_argnames=(
        "target_graphdef", "head_graphdef", "num_steps", "num_draft", "sampling", "tree", "forced_accept_prob",
        "kernels",
    ),
    donate_argnums=(4,),
)


def check_head_fits(target: LlamaModel, head: Eagle3Head) -> None:
    """The static checks of loading, plus: the target was built to return the features this head reads."""
    validate_head(head.config, target.config)
    wanted = head.config.aux_layer_ids
    if wanted is not None and tuple(wanted) != tuple(target.config.aux_layer_ids):
        raise JaxspecError(
            f"draft head reads target layers {tuple(wanted)}, but the target was built to return "
            f"{target.config.aux_layer_ids} (load the target with aux_layer_ids={tuple(wanted)})"
        )


class SpeculativeGenerator(TargetGenerator):
    """Generates with the target verifying chains of `num_draft` EAGLE-3 drafts, or EAGLE-2 dynamic trees when
    `tree` is given; output equals target-only generation under greedy decoding and follows the same distribution
    under sampling.

    kernels: the draft verifier's implementation ("reference", "pallas" or "interpret", `pallas_kernels.dispatch`);
    None follows the target's numerics (whose attention the same choice set), or `auto` for plain numerics."""

    def __init__(
        self,
        model: LlamaModel,
        head: Eagle3Head,
        *,
        num_draft: int = 5,
        tree: TreeConfig | None = None,
        batch_size: int = 1,
        chunk_steps: int = 4,
        mesh: jax.sharding.Mesh | None = None,
        forced_accept_prob: float | None = None,
        kernels: str | None = None,
    ):
        if tree is None and num_draft < 1:
            raise JaxspecError(f"--num-speculative-tokens must be >= 1, got {num_draft}")
        check_head_fits(model, head)
        if tree is not None and tree.top_k > head.config.draft_vocab_size:
            raise JaxspecError(f"tree TOPK={tree.top_k} exceeds the head's draft vocabulary ({head.config.draft_vocab_size})")
        if forced_accept_prob is not None:  # benchmarks only: the output is then not the target's
            if tree is not None:
                raise JaxspecError("--accept-prob (forced acceptance, benchmarks only) applies to chains, not --tree")
            if not 0.0 <= forced_accept_prob <= 1.0:
                raise JaxspecError(f"--accept-prob must be in [0, 1], got {forced_accept_prob}")
        super().__init__(model, batch_size=batch_size, chunk_steps=chunk_steps, mesh=mesh)
        self.head_graphdef, self.head_params = nnx.split(head)
        if mesh is not None:
            sharding.check_fits(mesh, {"draft head": head.config}, batch_size)
            self.head_params = sharding.shard_params(self.head_params, mesh)
        self.tree = tree
        self.num_draft = tree.depth if tree is not None else num_draft  # the longest acceptable run of drafts
        self._models = (self.graphdef, self.params, self.head_graphdef, self.head_params)
        self._prefill_fn, self._step_fn = _prefill, _steps
        self._extra_static = {"num_draft": self.num_draft}
        if kernels is None:
            kernels = model.numerics.kernels if model.numerics is not None else resolve_kernels()
        if kernels not in IMPLEMENTATIONS:
            raise JaxspecError(f"kernels must be one of {', '.join(IMPLEMENTATIONS)}, got {kernels!r}")
        self.kernels = kernels
        self._step_static = {"tree": tree, "forced_accept_prob": forced_accept_prob, "kernels": kernels}

    @property
    def extra_capacity(self) -> int:
        """Slots past the committed length one step may write: the verify block, and the head's tree levels."""
        if self.tree is None:
            return self.num_draft + 1
        return max(self.tree.total_tokens, self.tree.depth + 1 + self.tree.window)

    def _memory_parts(self, st) -> dict:
        return {
            "target_parameters": device_bytes(self.params), "target_kv_cache": device_bytes(st.target_cache),
            "head_parameters": device_bytes(self.head_params), "head_kv_cache": device_bytes(st.head_cache),
        }

    def _batch_stats(self, st, n_rows: int) -> list[dict]:
        calls, generated, accepted = (sharding.to_host(x) for x in (st.verify_calls, st.num_generated, st.accepted))
        stats = []
        for row in range(n_rows):
            c = int(calls[row])
            stats.append({
                # tokens per target verify call, bonus included (the first token comes from the prefill)
                "mean_accepted_length": round((int(generated[row]) - 1) / c, 4) if c else 0.0,
                "acceptance_per_position": [round(float(x) / c, 4) if c else 0.0 for x in accepted[row]],
                "target_calls": c + 1,
                "draft_calls": c * (self.num_draft if self.tree is None else self.tree.depth) + 1,
            })
        return stats
