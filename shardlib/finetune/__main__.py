"""`python -m shardlib.finetune ...` (also under torchrun and accelerate launch)."""

import sys

from shardlib.finetune.cli import main

sys.exit(main())
