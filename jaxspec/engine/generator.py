"""The EAGLE-3 generator: `Generator` with an EAGLE-3 head as its proposer, checked against the target."""

from __future__ import annotations

import jax
from flax import nnx

from jaxspec import sharding
from jaxspec.checkpoints.heads import validate_head
from jaxspec.errors import JaxspecError
from jaxspec.engine.generation import Generator
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.models.llama import LlamaModel
from jaxspec.engine.proposers.eagle3 import Eagle3Proposer, PEagleProposer
from jaxspec.engine.proposers.lookup import PromptLookup, beside
from jaxspec.engine.tree import TreeConfig


def check_head_fits(target: LlamaModel, head: Eagle3Head) -> None:
    """The static checks of loading, plus: the target was built to return the features this head reads."""
    validate_head(head.config, target.config)
    wanted = head.config.aux_layer_ids
    if wanted is not None and tuple(wanted) != tuple(target.config.aux_layer_ids):
        raise JaxspecError(
            f"draft head reads target layers {tuple(wanted)}, but the target was built to return "
            f"{target.config.aux_layer_ids} (load the target with aux_layer_ids={tuple(wanted)})"
        )


class SpeculativeGenerator(Generator):
    """Generates with the target verifying chains of `num_draft` EAGLE-3 drafts (a P-EAGLE head's from one forward,
    `PEagleProposer`), or EAGLE-2 dynamic trees when `tree` is given; output equals target-only generation under
    greedy decoding and follows the same distribution under sampling. `lookup`: prompt lookup beside the head's
    chains (`proposers.lookup`; trees ignore it). A convenience constructor: everything else is `Generator`'s."""

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
        lookup: PromptLookup | None = None,
    ):
        if tree is None and num_draft < 1:
            raise JaxspecError(f"--num-speculative-tokens must be >= 1, got {num_draft}")
        check_head_fits(model, head)
        if tree is not None and tree.top_k > head.config.draft_vocab_size:
            raise JaxspecError(f"tree TOPK={tree.top_k} exceeds the head's draft vocabulary ({head.config.draft_vocab_size})")
        if mesh is not None:
            sharding.check_fits(mesh, {"draft head": head.config}, batch_size)
        graphdef, params = nnx.split(head)
        if tree is None and head.config.mask_token_id is not None:  # a P-EAGLE head drafts its chain in one forward
            proposer = PEagleProposer(graphdef, num_draft=num_draft)
        else:
            proposer = Eagle3Proposer(graphdef, num_draft=tree.depth if tree is not None else num_draft, tree=tree)
        proposer = beside(proposer, lookup)
        super().__init__(
            model, proposer=proposer, proposer_params=params, batch_size=batch_size, chunk_steps=chunk_steps,
            mesh=mesh, forced_accept_prob=forced_accept_prob, kernels=kernels,
        )

    @property
    def head_params(self) -> nnx.State:
        return self.proposer_params

    @property
    def tree(self) -> TreeConfig | None:
        return self.proposer.tree
