import sys

from relax.cli import main

sys.exit(main())
