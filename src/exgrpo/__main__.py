import sys

from exgrpo.cli import main

sys.exit(main())
