"""One ILP worker process of :mod:`autopar_lab.pricing.table_pool`: ``python -m autopar_lab.pricing.table_worker``
reads its setup and meshes from stdin and writes each mesh's result to stdout (pickles)."""

import os
import sys

from autopar_lab.pricing.table_pool import serve

if __name__ == "__main__":
    # The pipe to the parent is this process's original stdout; anything printed goes to stderr instead.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    serve(sys.stdin.buffer, out)
