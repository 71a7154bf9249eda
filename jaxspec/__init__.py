"""jaxspec: speculative decoding for Llama-family models in JAX."""

from jaxspec import _moved
from jaxspec.config import TargetConfig, load_target_config
from jaxspec.errors import JaxspecError

_moved.install()

__all__ = ["JaxspecError", "TargetConfig", "load_target_config"]
__version__ = "0.1.0"
