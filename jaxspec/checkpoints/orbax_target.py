"""A target converted once to an orbax checkpoint: reloads without parsing safetensors or transposing weights,
and restores straight into given shardings (each host reads only its shards).

Layout: the Hugging Face directory's config.json, tokenizer and generation files, plus
  params/               orbax StandardCheckpointer directory holding the NNX parameter state (model dtype)
  jaxspec_orbax.json    {"dtype": ...}
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
from jaxspec.models.llama import LlamaModel

MARKER = "jaxspec_orbax.json"
_COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


def is_orbax_target(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def save_target_orbax(model: LlamaModel, source_dir: str | Path, out_dir: str | Path) -> Path:
    out = Path(out_dir).absolute()
    if out.exists() and any(out.iterdir()):
        raise JaxspecError(f"output directory {str(out)!r} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    for name in _COPIED:
        if (Path(source_dir) / name).is_file():
            shutil.copy(Path(source_dir) / name, out / name)
    _, state = nnx.split(model)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(out / "params", nnx.to_pure_dict(state))
    (out / MARKER).write_text(json.dumps({"dtype": str(model.dtype)}))
    return out


def load_target_orbax(path: str | Path, *, dtype=None, aux_layer_ids=None, shardings=None) -> LlamaModel:
    """Restore a converted target, cast to `dtype` (default: as saved) by orbax while reading; `shardings` (a
    function from the abstract state to a pytree like it of jax.sharding.Sharding) places each array as it is
    read."""
    path = Path(path).absolute()
    dtype = jnp.dtype(dtype or json.loads((path / MARKER).read_text())["dtype"])
    cfg = load_target_config(path, aux_layer_ids)
    model = nnx.eval_shape(lambda: LlamaModel(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, abstract = nnx.split(model)
    target = nnx.to_pure_dict(abstract)
    if shardings is not None:
        target = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), target, shardings(target)
        )
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path / "params", target)
    nnx.replace_by_pure_dict(abstract, restored)
    return nnx.merge(graphdef, abstract)
