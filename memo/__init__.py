"""memo: train transformers on very long sequences on few GPUs.

Token-wise activation offload/recompute (the Memo method), a bi-level MIP
memory planner, and a planned, fragmentation-free activation allocator.
See README.md and DESIGN.md for the picture.
"""

# torch must be imported before memo._C: the extension links against libc10/libtorch.
import torch  # noqa: F401

from memo._version import __version__
from memo.runtime import unwrap, wrap

__all__ = ["__version__", "unwrap", "wrap"]
