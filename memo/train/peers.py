"""An alias of :mod:`memo.runtime.peers`, where the peers live (``memo estimate`` records them too,
below ``memo.train``); this import path is kept for one release."""

import warnings

from memo.runtime.peers import *  # noqa: F403
from memo.runtime.peers import __all__  # noqa: F401

warnings.warn("memo.train.peers moved to memo.runtime.peers; import it from there (this path goes in the "
              "next release)", DeprecationWarning, stacklevel=2)
