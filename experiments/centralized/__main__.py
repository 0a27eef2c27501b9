"""`python -m experiments.centralized [--quick]`: see the package docstring."""
from experiments.centralized.driver import main

raise SystemExit(main())
