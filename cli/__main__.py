"""`python -m resilientjob.cli` is `rjob`."""

import sys

from resilientjob.cli import main

sys.exit(main())
