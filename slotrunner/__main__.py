import sys

from slotrunner.cli import main

sys.exit(main())
