import sys

from kvgrid.cli import main

sys.exit(main())
