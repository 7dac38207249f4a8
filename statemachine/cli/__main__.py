import sys

from statemachine.cli import main

sys.exit(main())
