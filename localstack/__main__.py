"""`python -m resilientjob.localstack <state dir>`: the background process behind `rjob local up`."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from .stack import serve

if __name__ == "__main__":
    # `stack.log`: what was restarted and every library's warning, each dated as a kubelet's log is.
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    asyncio.run(serve(Path(sys.argv[1])))
