"""`python -m experiments.diloco [--quick]`: see the package docstring."""
from experiments.diloco.driver import main

raise SystemExit(main())
