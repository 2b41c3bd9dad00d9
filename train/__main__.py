"""`accelerate launch -m sparseforge.train --config recipes/NAME.yaml [--set key=value ...] [--resume]`"""

import sys

from sparseforge.train.cli import main

sys.exit(main())
