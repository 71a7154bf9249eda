"""A target converted once to an orbax checkpoint: reloads without parsing safetensors or transposing weights,
and restores straight into given shardings (each host reads only its shards).

Layout: the Hugging Face directory's config.json, tokenizer and generation files, plus
  params/               orbax PyTree checkpoint of the NNX parameter state (model dtype, uncompressed)
  jaxspec_orbax.json    {"dtype": ..., "shapes": {"layers.0.mlp.down_proj.kernel": [I, H], ...}}, written last
                        (a directory without it is not a finished conversion)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from jaxspec.config import load_target_config
from jaxspec.errors import JaxspecError
from jaxspec.files import read_json
from jaxspec.models.target import TargetModel, target_model
from jaxspec.sharding import param_shardings

MARKER = "jaxspec_orbax.json"
_COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


def is_orbax_target(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def save_target_orbax(model: TargetModel, source_dir: str | Path, out_dir: str | Path) -> Path:
    out = Path(out_dir).absolute()
    if out.exists() and any(out.iterdir()):
        raise JaxspecError(f"output directory {str(out)!r} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    for name in _COPIED:
        if (Path(source_dir) / name).is_file():
            shutil.copy(Path(source_dir) / name, out / name)
    state = nnx.state(model, nnx.Param)  # the weights, without what generation derives from them (hold_step_weights)
    params = jax.tree.map(  # in the model dtype, however it holds them (numerics.held_dtype)
        lambda a: a.astype(model.dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, nnx.to_pure_dict(state)
    )
    # Uncompressed: zstd saves a third of the disk but its decoding dominated the restore (1.4 s vs 1.0 s for
    # SmolLM2 on 2 CPU cores), and reloading fast is the point of converting.
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False)) as ckptr:
        ckptr.save(out / "params", args=ocp.args.PyTreeSave(params))
    (out / MARKER).write_text(json.dumps({"dtype": str(model.dtype), "shapes": _shapes(params)}))
    return out


def _shapes(tree) -> dict[str, list[int]]:
    """Parameter name → shape, for checking a checkpoint against its config before orbax reads it."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path, simple=True, separator="."): list(leaf.shape) for path, leaf in leaves}


def _check_shapes(path: Path, saved: dict[str, list[int]] | None, expected: dict[str, list[int]]) -> None:
    if saved is None:  # converted before shapes were recorded: orbax checks the tree itself
        return
    problems = [f"{k} is missing" for k in expected if k not in saved]
    problems += [f"{k} is not in config.json" for k in saved if k not in expected]
    problems += [f"{k} has shape {saved[k]}, config.json implies {v}" for k, v in expected.items()
                 if k in saved and saved[k] != v]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise JaxspecError(
            f"orbax target {str(path)!r} does not match its config.json: {'; '.join(problems[:3])}{more}; "
            "convert the Hugging Face target again with `python -m jaxspec.convert target`"
        )


def load_target_orbax(path: str | Path, *, dtype=None, aux_layer_ids=None, mesh=None) -> TargetModel:
    """Restore a converted target, cast to `dtype` (default: as saved) by orbax while reading; with a (data,
    model) `mesh`, each array is read straight into its `sharding.param_shardings` placement."""
    path = Path(path).absolute()
    meta = read_json(path / MARKER, "the orbax target's record")
    if not isinstance(meta.get("dtype"), str):
        raise JaxspecError(f"{str(path / MARKER)!r} is corrupt (no dtype); convert the target again")
    dtype = jnp.dtype(dtype or meta["dtype"])
    cfg = load_target_config(path, aux_layer_ids)
    model = target_model(cfg, dtype=dtype, rngs=None)  # shapes only: every weight is read below
    graphdef, abstract = nnx.split(model)
    target = nnx.to_pure_dict(abstract)
    _check_shapes(path, meta.get("shapes"), _shapes(target))
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        placement = jax.tree.map(lambda _: device, target)
    else:
        placement = param_shardings(target, mesh)
    # Explicit restore arguments: StandardCheckpointer would first read every array's metadata to build them.
    restore_args = jax.tree.map(  # read in the model dtype, then held as the model holds it (numerics.held_dtype)
        lambda a, s: ocp.ArrayRestoreArgs(sharding=s, global_shape=a.shape, dtype=dtype), target, placement
    )
    try:
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
            restored = ckptr.restore(
                path / "params", args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args)
            )
    except Exception as e:  # orbax wraps tensorstore's errors in bare Exceptions: report the root cause
        while e.__cause__ is not None:
            e = e.__cause__
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise JaxspecError(
            f"cannot restore the orbax target {str(path)!r} ({first}); convert the target again"
        ) from None
    leaves, treedef = jax.tree.flatten(restored)
    del restored
    for i, like in enumerate(jax.tree.leaves(target)):  # leaf by leaf: each read copy is freed as its held one is made
        leaves[i] = leaves[i].astype(like.dtype)
    restored = jax.tree.unflatten(treedef, leaves)
    nnx.replace_by_pure_dict(abstract, restored)
    return nnx.merge(graphdef, abstract)
