"""`python -m mpidist ...` is `mpidist ...`."""
import sys

from mpidist.cli import main

sys.exit(main())
