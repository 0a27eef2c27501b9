"""`python -m experiments.architectures [--quick]`: see the package docstring."""
from experiments.architectures.driver import main

raise SystemExit(main())
