"""`python -m experiments.consistency [--quick]`: see the package docstring."""
from experiments.consistency.driver import main

raise SystemExit(main())
