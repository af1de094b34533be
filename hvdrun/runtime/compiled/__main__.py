"""``python -m hvdrun.runtime.compiled``: build the optional compiled module (see :mod:`hvdrun.runtime.compiled`)."""

import sys

from hvdrun.runtime.compiled import CompiledError, build

try:
    print(f"built {build()}")
except CompiledError as e:
    sys.exit(f"hvdrun: {e}")
