import os
import sys
from pathlib import Path

# Simulate 8 devices on CPU for sharding tests; must happen before JAX initializes its backends.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).parent))

import jax

jax.config.update("jax_default_matmul_precision", "highest")
