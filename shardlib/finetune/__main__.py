"""`python -m shardlib.finetune ...` (also under torchrun and accelerate launch)."""

import sys

from shardlib.finetune.train import main

sys.exit(main())
