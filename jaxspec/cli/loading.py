"""What the flags load: the target directory (the built-in one built on first use), the draft head (checked against
the target's config before any weights load), the target and its tokenizer, the speculative generator or n-gram
proposer the flags ask for, the kernels `--kernels` resolves to, and the store of timed step costs."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from jaxspec.cli.args import AUTO
from jaxspec.errors import JaxspecError


def resolve_target(target: str | None) -> Path:
    from jaxspec.checkpoints.builtin import ensure_default_target

    if target is None:
        return ensure_default_target(log=lambda msg: print(msg, file=sys.stderr))
    return Path(target)


def resolve_draft(args) -> str | None:
    """The head to draft with: --draft; else, for the built-in target, the head shipped with jaxspec; else none.
    With --draft and no --target, a head whose config names its verifier picks the target: a local directory
    (absolute, or relative to the head) becomes args.target, the built-in target's name keeps the default; a
    verifier named but not found here is an error that says to pass --target. Call it before `resolve_target`."""
    from jaxspec.checkpoints.builtin import default_head_dir
    from jaxspec.checkpoints.heads import read_head_config
    from jaxspec.checkpoints.verifier import locate_verifier

    if args.no_draft:
        if args.draft:
            raise JaxspecError("--draft and --no-draft contradict each other; pass one")
        return None
    if getattr(args, "proposer", "eagle3") != "eagle3":
        return None  # drafts without a head
    if args.draft:
        raw = read_head_config(args.draft)  # a missing head fails here, before any target is built
        if args.target is None:
            verifier = locate_verifier(raw, args.draft)
            if verifier is not None:
                print(f"target: {verifier} (the verifier the head's config names)", file=sys.stderr)
                args.target = str(verifier)
        return args.draft
    if args.target is None and (default_head_dir() / "config.json").is_file():
        print(f"draft: the built-in EAGLE-3 head ({default_head_dir().name}); --no-draft for target-only",
              file=sys.stderr)
        return str(default_head_dir())
    return None


def kernels_impl(args) -> str:
    """The implementation `--kernels` (or JAXSPEC_KERNELS under auto) resolves to here: reference, pallas or
    interpret (`pallas_kernels.dispatch`)."""
    from pallas_kernels.dispatch import resolve_kernels

    try:
        return resolve_kernels(getattr(args, "kernels", "auto"))
    except ValueError as e:
        raise JaxspecError(str(e)) from None


def head_aux_layer_ids(draft: str | None, target_dir: Path):
    """The target layers a head reads (None: the target's default), read from the two config.json files and checked
    (the verifier the head was exported for, vocabulary, hidden sizes, layer ids) before any weights are loaded."""
    if draft is None:
        return None
    from jaxspec.checkpoints.heads import head_config_from_hf, read_head_config, validate_head
    from jaxspec.checkpoints.verifier import head_record
    from jaxspec.config import load_target_config

    from jaxspec.checkpoints.dflash import is_dflash

    raw = read_head_config(draft)
    from jaxspec.checkpoints.gemma4_assistant import assistant_config_from_hf, check_assistant_fits, is_gemma4_assistant

    if is_gemma4_assistant(raw):  # reads the target's cache and final hidden state, no features
        check_assistant_fits(assistant_config_from_hf(raw), load_target_config(target_dir))
        return None
    if is_dflash(raw):
        from jaxspec.checkpoints.dflash import check_drafter_fits, dflash_config_from_hf

        target = load_target_config(target_dir)
        drafter = dflash_config_from_hf(raw, target)
        check_drafter_fits(drafter, target, built=False)
        return drafter.aux_layer_ids
    head = head_config_from_hf(raw)[1]
    validate_head(head, load_target_config(target_dir), head_record(raw)[0])
    return head.aux_layer_ids


def is_assistant_draft(draft: str | None) -> bool:
    """Whether --draft names a Gemma 4 assistant (Gemma4AssistantForCausalLM)."""
    if draft is None:
        return False
    from jaxspec.checkpoints.gemma4_assistant import is_gemma4_assistant
    from jaxspec.checkpoints.heads import read_head_config

    return is_gemma4_assistant(read_head_config(draft))


def is_dflash_draft(draft: str | None) -> bool:
    """Whether --draft names a DFlash block drafter (z-lab's layout) rather than an EAGLE-3 head."""
    if draft is None:
        return False
    from jaxspec.checkpoints.dflash import is_dflash
    from jaxspec.checkpoints.heads import read_head_config

    return is_dflash(read_head_config(draft))


class Checked(NamedTuple):
    """What `check_before_loading` read, which the run goes on with."""

    tokenizer: Any
    encoded: list[list[int]]  # the prompts' token ids
    stop_ids: list[int]
    grammar: Any  # the --regex / --json-schema / --choice automaton (jaxspec.grammar.TokenAutomaton), or None


def check_mesh_fits(mesh, config, draft: str | None, batch_sizes: list[int], batch_flag: str = "--batch-size") -> None:
    """The mesh (None: one device) fits the target's and the draft's attention heads, and each batch size (a
    server's slots) its data axis: one-line errors from the config.json files alone."""
    from jaxspec import sharding

    if mesh is None:
        return
    configs = {"target": config}
    if draft is not None:
        from jaxspec.checkpoints.heads import head_config_from_hf, read_head_config

        from jaxspec.checkpoints.dflash import dflash_config_from_hf, is_dflash

        from jaxspec.checkpoints.gemma4_assistant import assistant_config_from_hf, is_gemma4_assistant

        raw = read_head_config(draft)
        if is_gemma4_assistant(raw):
            configs["assistant"] = assistant_config_from_hf(raw).text
        elif is_dflash(raw):
            configs["drafter"] = dflash_config_from_hf(raw, config)
        else:
            configs["draft head"] = head_config_from_hf(raw)[1]
    for batch_size in batch_sizes:
        sharding.check_fits(mesh, configs, batch_size, batch_flag)


def check_before_loading(args, target_dir: Path, draft: str | None, mesh, prompts: list[str],
                         batch_sizes: list[int], processors=None) -> Checked:
    """What the README promises before any weights load, from the two config.json files, the weights' headers and
    the tokenizer alone, in this order: the mesh fits the target's and the head's attention heads and each batch
    size its data axis; the weight files are whole safetensors (`check_weight_files`), the draft's too; with a
    draft, a JAXSPEC_STEP_COSTS store is one (`step_cost_store`); each prompt plus --max-new-tokens fits the
    context; the logit biases name tokens of the vocabulary; --regex / --json-schema / --choice compile for the
    tokenizer."""
    from jaxspec.cli.args import structured_output
    from jaxspec.config import load_target_config
    from jaxspec.engine.generation import check_prompt_lengths
    from jaxspec.processors import check_vocab
    from jaxspec.prompts import encode_prompt, load_tokenizer, stop_token_ids

    config = load_target_config(target_dir)
    check_mesh_fits(mesh, config, draft, batch_sizes)
    check_files_before_loading(args, target_dir, draft)
    tokenizer = load_tokenizer(target_dir)
    encoded = [encode_prompt(tokenizer, text, args.raw) for text in prompts]
    check_prompt_lengths([len(ids) for ids in encoded], args.max_new_tokens, config.context_length)
    if processors is not None:
        check_vocab([processors], config.vocab_size)
    stops = stop_token_ids(tokenizer, target_dir, config.eos_token_ids)
    return Checked(tokenizer, encoded, stops, structured_output(args, tokenizer, config.vocab_size, stops))


def check_files_before_loading(args, target_dir: Path, draft: str | None) -> None:
    """The files a run reads besides the configs, checked before any weights load (generate, bench and serve): the
    target's weight headers, the draft's (`--draft`, `--draft-model`) and, with a draft, JAXSPEC_STEP_COSTS
    (automatic speculation reads it; nothing else does)."""
    from jaxspec.checkpoints.hf import check_safetensors_headers, check_weight_files

    check_weight_files(target_dir)
    if draft is not None and Path(draft).is_dir():
        check_safetensors_headers(Path(draft))
    if args.draft_model is not None and Path(args.draft_model).expanduser().is_dir():
        check_weight_files(Path(args.draft_model).expanduser())
    if draft is not None or args.draft_model is not None:
        step_cost_store(args)  # a JAXSPEC_STEP_COSTS naming a directory or another file: one line now


def load_target_and_tokenizer(
    target_dir: Path, dtype: str | None, log=True, aux_layer_ids=None, mesh=None, numerics: str = "invariant",
    kernels: str | None = None, tokenizer=None, quantize: str | None = None,
):
    """(model, tokenizer) from a directory, with a note on stderr of how long loading took (an orbax target is
    restored straight into the mesh's shardings) and of the kernels it runs. numerics: "invariant" (the model's
    default) or "plain"; kernels: `--kernels` resolved (`kernels_impl`), None for auto; tokenizer: one loaded
    already (`check_before_loading`), else loaded here; quantize: `--quantize` (models/quantize.py), or None."""
    from jaxspec.checkpoints.hf import load_target
    from jaxspec.engine.generation import default_dtype
    from jaxspec.prompts import load_tokenizer
    from pallas_kernels.dispatch import describe, resolve_kernels

    start = time.perf_counter()
    model = load_target(target_dir, dtype=dtype or default_dtype(), aux_layer_ids=aux_layer_ids, mesh=mesh,
                        quantize=quantize)
    model.numerics = None if numerics == "plain" else model.invariant_numerics(kernels)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(target_dir)
    if log:
        cfg = model.config
        print(
            f"loaded {target_dir.name} ({cfg.model_type}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
            f"{model.dtype}{f', {model.quantization} weights' if model.quantization else ''}) "
            f"in {time.perf_counter() - start:.1f}s",
            file=sys.stderr,
        )
        print(describe(kernels or resolve_kernels()), file=sys.stderr)
    return model, tokenizer


def load_head_for(draft: str, target, dtype: str | None, allow_pickle: bool):
    """An EAGLE-3 head for `target` in `dtype` (None: the default), as stored: its matmuls are plain XLA dots.
    Generation wants `load_draft_for`, which also holds them on the CPU row kernel where the target's run there
    (on CPU the head's step then costs about half: BENCHMARKS.md, "The CPU's argmax")."""
    from jaxspec.checkpoints.heads import load_head
    from jaxspec.engine.generation import default_dtype

    return load_head(draft, target.config, dtype=dtype or default_dtype(), allow_pickle=allow_pickle)


def recorded_acceptance(draft: str) -> list[dict] | None:
    """The acceptance profile a draft's config records (a jaxspec export's), checked (a bad one: a one-line error),
    or None: automatic speculation's prior, for a head and a DFlash drafter alike."""
    from jaxspec.checkpoints.heads import read_head_config
    from jaxspec.checkpoints.verifier import check_acceptance, head_record

    record = head_record(read_head_config(draft))[1]
    return check_acceptance(record) if record else None


def speculative_generator(model, head, draft: str, num_draft: int | str, tree, *, batch_size: int, mesh=None,
                          kernels: str | None = None, forced_accept_prob: float | None = None, store=None,
                          lookup=None):
    """The EAGLE-3 generator the flags ask for: a tree, a fixed chain, or (num_draft == "auto") the chain length or
    recorded tree chosen per batch, whose prior is the acceptance profile recorded in the head's config (if any),
    with step costs from `store` (`step_cost_store`; None: timed in this process). `lookup`: prompt lookup beside
    the chains (`args.prompt_lookup`; None: none)."""
    from jaxspec.engine.generator import SpeculativeGenerator

    if tree is None and num_draft == AUTO:
        from jaxspec.engine.auto.config import profile_from_record, trees_from_record
        from jaxspec.engine.auto.generator import AutoSpeculativeGenerator

        record = recorded_acceptance(draft)
        return AutoSpeculativeGenerator(model, head, prior=profile_from_record(record), trees=trees_from_record(record),
                                        batch_size=batch_size, mesh=mesh, kernels=kernels, store=store,
                                        lookup=lookup)
    return SpeculativeGenerator(
        model, head, num_draft=num_draft if tree is None else 1, tree=tree, batch_size=batch_size, mesh=mesh,
        kernels=kernels, forced_accept_prob=forced_accept_prob, lookup=lookup,
    )


def load_draft_for(draft: str, target, dtype: str | None, allow_pickle: bool, mesh=None):
    """What a --draft directory holds, loaded for this target: a Gemma 4 assistant, a DFlash block drafter (z-lab's
    layout; checked to read features the target returns) or an EAGLE-3 head. A head's or a DFlash drafter's
    matmuls run on the CPU row kernel where the target's do (`llama.hold_draft_weights`), unless a model axis of
    `mesh` splits them."""
    from jaxspec.models.llama import hold_draft_weights
    from pallas_kernels.mesh_axes import MODEL

    if is_assistant_draft(draft):
        from jaxspec.checkpoints.gemma4_assistant import load_assistant
        from jaxspec.engine.generation import default_dtype

        return load_assistant(draft, target.config, dtype=dtype or default_dtype())
    if not is_dflash_draft(draft):
        drafter = load_head_for(draft, target, dtype, allow_pickle)
    else:
        from jaxspec.checkpoints.dflash import check_drafter_fits, load_dflash
        from jaxspec.engine.generation import default_dtype

        drafter = load_dflash(draft, target.config, dtype=dtype or default_dtype())
        check_drafter_fits(drafter.config, target.config)  # and the target returns the features it reads
    if mesh is None or mesh.shape[MODEL] == 1:
        hold_draft_weights(drafter, target)
    return drafter


def draft_generator(model, drafter, draft: str, num_draft: int | str, tree, *, batch_size: int, mesh=None,
                    kernels: str | None = None, forced_accept_prob: float | None = None, store=None, lookup=None):
    """The generator the flags ask for with a loaded draft (`load_draft_for`, `load_draft_model`): an EAGLE-3
    head's (`speculative_generator`); a DFlash drafter's chains of --num-speculative-tokens drafts, one drafter
    forward per step; a draft model's chains, K of its forwards per step. auto: the chain length (or target-only)
    chosen per batch as for a head (`AutoSpeculativeGenerator`), from the acceptance the drafter's config records
    (a jaxspec export's; a draft model has none: its first batch measures it) and this machine's step costs.
    `lookup` (`args.prompt_lookup`): prompt lookup beside every chain (a Gemma 4 assistant's too); trees draft
    from the drafter alone."""
    from jaxspec.models.dflash import DFlashDrafter
    from jaxspec.models.gemma4_assistant import Gemma4Assistant
    from jaxspec.models.llama import LlamaModel

    if isinstance(drafter, Gemma4Assistant):
        return assistant_generator(model, drafter, draft, num_draft, tree, batch_size=batch_size, mesh=mesh,
                                   kernels=kernels, forced_accept_prob=forced_accept_prob, lookup=lookup)
    if not isinstance(drafter, (DFlashDrafter, LlamaModel)):
        return speculative_generator(model, drafter, draft, num_draft, tree, batch_size=batch_size, mesh=mesh,
                                     kernels=kernels, forced_accept_prob=forced_accept_prob, store=store,
                                     lookup=lookup)
    from jaxspec.engine.generation import Generator
    from jaxspec.engine.proposers.dflash import DFlashProposer
    from jaxspec.engine.proposers.draft_model import DraftModelProposer
    from jaxspec.engine.proposers.lookup import beside

    block = isinstance(drafter, DFlashDrafter)
    what = "a DFlash drafter" if block else "a draft model"
    if forced_accept_prob is not None and (not block or tree is not None or num_draft == AUTO):
        raise JaxspecError(f"--accept-prob forces the acceptance of a fixed chain of an EAGLE-3 head or a DFlash "
                           f"drafter; drop it for {what}" + (" with --tree or auto" if block else ""))
    if tree is not None:  # a tree from the block's slots or the draft model's levels (auto prices chains only)
        proposer, params = (DFlashProposer.of if block else DraftModelProposer.of)(drafter, tree.depth, tree)
        return Generator(model, proposer=proposer, proposer_params=params, batch_size=batch_size, mesh=mesh,
                         kernels=kernels)
    if num_draft == AUTO:
        from jaxspec.engine.auto.config import profile_from_record
        from jaxspec.engine.auto.generator import AutoSpeculativeGenerator

        prior = profile_from_record(recorded_acceptance(draft)) if block else None
        return AutoSpeculativeGenerator(model, drafter, prior=prior, batch_size=batch_size, mesh=mesh,
                                        kernels=kernels, store=store, lookup=lookup)
    proposer, params = (DFlashProposer.of if block else DraftModelProposer.of)(drafter, num_draft)
    proposer = beside(proposer, lookup)
    return Generator(model, proposer=proposer, proposer_params=params, batch_size=batch_size, mesh=mesh,
                     kernels=kernels, forced_accept_prob=forced_accept_prob)


def auto_among_drafters(model, drafts: Sequence[str], aux_ids: Sequence, *, dtype: str | None, allow_pickle: bool,
                        batch_size: int, mesh=None, kernels: str | None = None, store=None, lookup=None):
    """`auto` among several drafters of one target (`generate --also-draft`; `engine.auto.among`): each drafter's
    own `AutoSpeculativeGenerator`, over a view of the target returning the features that drafter reads
    (`models.target.with_aux_layers`: the same weights), and per batch the best of their choices. aux_ids: each
    drafter's layers (`head_aux_layer_ids`; None: the target's default)."""
    from jaxspec.engine.auto.among import AutoAmongDrafters
    from jaxspec.engine.auto.generator import AutoSpeculativeGenerator
    from jaxspec.models.target import with_aux_layers
    from pallas_kernels.mesh_axes import MODEL

    if mesh is None or mesh.shape[MODEL] == 1:  # as a Generator would: held before the views, so that they share it
        model.hold_step_weights()
    generators = []
    for path, ids in zip(drafts, aux_ids):
        view = with_aux_layers(model, model.config.aux_layer_ids if ids is None else ids)
        drafter = load_draft_for(path, view, dtype, allow_pickle, mesh)
        gen = draft_generator(view, drafter, path, AUTO, None, batch_size=batch_size, mesh=mesh, kernels=kernels,
                              store=store, lookup=lookup)
        if not isinstance(gen, AutoSpeculativeGenerator):
            raise JaxspecError(f"--also-draft: automatic speculation cannot price {path}'s drafts (a Gemma 4 "
                               "assistant); draft with it alone")
        generators.append(gen)
    names = [Path(p).name or str(p) for p in drafts]
    if len(set(names)) < len(names):
        names = [str(p) for p in drafts]
    if len(set(names)) < len(names):
        raise JaxspecError(f"--also-draft names the same drafter as --draft ({drafts[0]}); give another")
    return AutoAmongDrafters(generators, names)


ASSISTANT_DEFAULT_DRAFTS = 4  # `auto` with a Gemma 4 assistant, unless its generation_config.json says otherwise


def assistant_generator(model, assistant, draft: str, num_draft: int | str, tree, *, batch_size: int, mesh=None,
                        kernels: str | None = None, forced_accept_prob: float | None = None, lookup=None):
    """Chains of a Gemma 4 assistant. `auto` does not price it yet: it runs the chain its generation_config.json
    names (`num_assistant_tokens`, as transformers' assisted generation does), else ASSISTANT_DEFAULT_DRAFTS."""
    from jaxspec.engine.generation import Generator
    from jaxspec.engine.proposers.gemma4_assistant import AssistantProposer
    from jaxspec.files import read_json

    if tree is not None:
        raise JaxspecError("a Gemma 4 assistant drafts one chain per step; drop --tree")
    if forced_accept_prob is not None:
        raise JaxspecError("--accept-prob forces an EAGLE-3 head's acceptance; drop it for a Gemma 4 assistant")
    if num_draft == AUTO:
        config = Path(draft) / "generation_config.json"
        named = read_json(config, "the assistant's generation_config.json") if config.is_file() else {}
        num_draft = int(named.get("num_assistant_tokens") or ASSISTANT_DEFAULT_DRAFTS)
    proposer, params = AssistantProposer.of(assistant, model.config, num_draft)
    from jaxspec.engine.proposers.lookup import beside

    proposer = beside(proposer, lookup)
    return Generator(model, proposer=proposer, proposer_params=params, batch_size=batch_size, mesh=mesh,
                     kernels=kernels)


def ngram_proposer(args):
    """The n-gram proposer of `--proposer ngram`, or None."""
    if getattr(args, "proposer", "eagle3") != "ngram":
        return None
    from jaxspec.engine.proposers.ngram import NgramProposer

    return NgramProposer(args.num_speculative_tokens, args.ngram_min, args.ngram_max)


def load_draft_model(args, target, tokenizer):
    """The draft model of `--proposer draft-model --draft-model DIR` (a LlamaModel), or None. The draft must share
    the target's tokenizer (the same vocabulary; its embedding may be padded past it) and reach its context."""
    if getattr(args, "proposer", "eagle3") != "draft-model":
        return None
    from jaxspec.checkpoints.hf import load_target
    from jaxspec.engine.generation import default_dtype
    from jaxspec.engine.proposers.draft_model import check_draft_model_fits
    from jaxspec.prompts import load_tokenizer

    where = Path(args.draft_model).expanduser()
    if not (where / "config.json").is_file():
        raise JaxspecError(f"--draft-model {args.draft_model!r} has no config.json: give a Hugging Face model "
                           "directory")
    try:
        theirs = load_tokenizer(where).get_vocab()
    except (OSError, ValueError) as e:
        raise JaxspecError(f"--draft-model {args.draft_model!r}: its tokenizer cannot be read ({e}); a draft model "
                           "must ship the target's tokenizer") from None
    if theirs != tokenizer.get_vocab():
        raise JaxspecError(f"--draft-model {args.draft_model!r} has another tokenizer than the target: a draft model "
                           "must share the target's vocabulary (pick one of the target's family)")
    draft = load_target(where, dtype=args.dtype or default_dtype())
    check_draft_model_fits(draft, target)
    return draft


def step_cost_store(args):
    """The store of timed step costs for automatic speculation (`jaxspec.engine.auto.step_cost_store`), or None."""
    from jaxspec.engine.auto.step_cost_store import default_store

    return None if getattr(args, "no_stored_step_costs", False) else default_store()
