import sys

from sparseforge.cli import main

sys.exit(main())
