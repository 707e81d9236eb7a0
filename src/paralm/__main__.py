import sys

from paralm.cli import main

sys.exit(main())
