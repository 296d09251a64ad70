"""`python -m resilientjob.localstack <state dir>`: the background process behind `rjob local up`."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from .stack import serve

if __name__ == "__main__":
    asyncio.run(serve(Path(sys.argv[1])))
