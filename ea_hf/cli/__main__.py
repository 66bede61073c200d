"""``python -m ea_hf.cli``: what ``torchrun``/``accelerate launch -m`` start in each process."""

import sys

from . import main

sys.exit(main())
