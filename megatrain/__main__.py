"""`python -m megatrain ...` (and `torchrun ... -m megatrain train ...`): the command line (megatrain/cli/)."""

import sys

from megatrain.cli import main

sys.exit(main())
