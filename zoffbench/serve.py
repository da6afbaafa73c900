"""The child process of harness.run_function: imports a module and reports what one of its functions returns.

    python -m zoffbench.serve ROOT MODULE FUNCTION KWARGS_JSON    # MODULE.FUNCTION(**KWARGS), ROOT first on sys.path
"""

from __future__ import annotations

import sys

from zoffbench.harness import serve

if __name__ == "__main__":
    serve(*sys.argv[1:])
