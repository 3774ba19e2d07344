"""`python -m gpuusage` runs the CLI."""

import sys

from gpuusage.cli import main

sys.exit(main())
